"""Tokens to KV blocks: the one rounding rule, for the engine and the gateway alike (no torch)."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `num_tokens` tokens (a partly filled block counts whole)."""
    return -(-num_tokens // block_size)
