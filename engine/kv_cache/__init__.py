"""Paged KV cache bookkeeping: block hashing, the block pool and per-request block tables (no torch)."""
