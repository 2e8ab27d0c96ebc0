"""KV tiers below a worker's memory: a host tier shared by the workers of one node (an owner process)
and a disk tier (a directory), keyed by the prefix cache's chain hashes (engine.kv_tiers.tiers)."""
