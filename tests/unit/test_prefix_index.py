"""The gateway's prefix index: the block hash chain over prompts, longest held prefix, LRU bound per worker."""

from __future__ import annotations

from engine.kv_cache.block_hash import prompt_block_hashes
from services.gateway.prefix_index import PrefixIndex


def test_hashes_cover_full_blocks_and_chain_over_the_prefix() -> None:
    a = prompt_block_hashes(list(range(40)), 16)
    assert len(a) == 2
    b = prompt_block_hashes([99, *range(1, 40)], 16)
    # The same second block after a different first block is a different prefix.
    assert a[0] != b[0] and a[1] != b[1]
    assert prompt_block_hashes(list(range(40)), 16) == a


def test_the_longest_recorded_prefix_is_found_per_worker() -> None:
    index = PrefixIndex()
    system = list(range(64))
    index.record("p1", prompt_block_hashes([*system, 1, 2, 3], 16), capacity_blocks=100)
    other = prompt_block_hashes([*system, 7, 8, 9, *range(100, 130)], 16)
    assert index.cached_tokens("p1", other, 16) == 64
    assert index.cached_tokens("p2", other, 16) == 0
    index.forget("p1")
    assert index.cached_tokens("p1", other, 16) == 0


def test_each_worker_keeps_at_most_its_capacity_most_recent_first() -> None:
    index = PrefixIndex()
    old = prompt_block_hashes(list(range(32)), 16)
    new = prompt_block_hashes(list(range(1000, 1032)), 16)
    index.record("p", old, capacity_blocks=2)
    index.record("p", new, capacity_blocks=2)
    assert index.cached_tokens("p", old, 16) == 0
    assert index.cached_tokens("p", new, 16) == 32
