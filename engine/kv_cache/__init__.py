"""The paged KV cache: block hashing, the block pool, per-request block tables and the tokens-to-blocks
rule (all torch-free, the gateway uses some), cache_engine.py, the K/V tensors themselves, and
codec.py, the format their pages hold (--kv-cache-dtype)."""
