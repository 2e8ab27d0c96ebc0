"""Tensor parallelism inside one worker: a model's heads, MLP columns and vocabulary split across
ranks (Megatron-style), each rank holding its shard of the weights and of the KV cache."""
