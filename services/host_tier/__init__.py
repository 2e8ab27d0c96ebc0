"""The node's KV host tier: one owner process holding KV blocks in memory for its node's workers."""
