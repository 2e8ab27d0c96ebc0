"""BlockPool: exact block ids, ref counts, free-list order and LRU eviction of cached blocks."""

import pytest

from engine.kv_cache.block_pool import BlockPool

H0, H1, H2 = (bytes([i]) * 32 for i in range(3))


def test_allocate_takes_lowest_ids_first_with_ref_one():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.num_free == 1
    pool.check_invariants()


def test_allocate_failure_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]
    pool.check_invariants()


def test_allocate_zero_and_negative():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_freed_unhashed_blocks_return_to_free_list_tail_in_order():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.decref([2, 0])
    assert pool.allocate(3) == [3, 2, 0]
    pool.check_invariants()


def test_decref_keeps_block_while_still_referenced():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.register(0, H0)
    pool.touch(0)  # a second request shares the cached block
    assert pool.ref_count(0) == 2
    pool.decref([0])
    assert pool.ref_count(0) == 1
    assert pool.num_free == 1
    pool.check_invariants()


def test_decref_of_free_block_is_rejected():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.decref([1])
    pool.check_invariants()


def test_cached_blocks_stay_findable_and_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for block_id, block_hash in zip([0, 1, 2], [H0, H1, H2], strict=True):
        pool.register(block_id, block_hash)
    pool.decref([2, 1, 0])
    pool.decref([3])
    assert pool.num_free == 4
    assert pool.num_cached == 3
    assert [pool.lookup(h) for h in (H0, H1, H2)] == [0, 1, 2]
    pool.check_invariants()

    # The plain free list goes first; cached blocks survive it.
    assert pool.allocate(1) == [3]
    assert pool.num_cached == 3
    # Then eviction in the order the blocks were freed, dropping each evicted hash.
    assert pool.allocate(1) == [2]
    assert pool.lookup(H2) is None
    assert pool.block_hash(2) is None
    assert pool.lookup(H1) == 1
    assert pool.allocate(2) == [1, 0]
    assert pool.num_cached == 0
    assert pool.allocate(1) is None
    pool.check_invariants()


def test_touch_takes_evictable_block_out_of_lru():
    pool = BlockPool(3)
    pool.allocate(2)
    pool.register(0, H0)
    pool.register(1, H1)
    pool.decref([0, 1])
    pool.touch(0)
    assert pool.ref_count(0) == 1
    assert pool.num_free == 2
    # Block 0 is referenced again, so it is no longer an eviction candidate.
    assert pool.allocate(2) == [2, 1]
    assert pool.lookup(H0) == 0
    assert pool.lookup(H1) is None
    pool.check_invariants()


def test_touch_of_referenced_cached_block_adds_a_reference():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.register(0, H0)
    pool.touch(0)
    assert pool.ref_count(0) == 2
    pool.check_invariants()


def test_touch_of_uncached_block_is_rejected():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.touch(0)
    pool.check_invariants()


def test_duplicate_hash_keeps_first_mapping_and_duplicate_is_freed_plainly():
    pool = BlockPool(3)
    pool.allocate(2)
    pool.register(0, H0)
    pool.register(1, H0)
    assert pool.lookup(H0) == 0
    assert pool.block_hash(1) is None
    assert pool.num_cached == 1
    pool.decref([1, 0])
    # Block 1 went back to the free list behind block 2; block 0 is evictable and reclaimed last.
    assert pool.allocate(3) == [2, 1, 0]
    pool.check_invariants()


def test_register_is_idempotent_but_rejects_rehash_and_unreferenced_blocks():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.register(0, H0)
    pool.register(0, H0)
    assert pool.num_cached == 1
    with pytest.raises(ValueError):
        pool.register(0, H1)
    with pytest.raises(ValueError):
        pool.register(1, H1)
    pool.check_invariants()


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_caching=False)
    pool.allocate(1)
    pool.register(0, H0)
    assert pool.num_cached == 0
    assert pool.lookup(H0) is None
    pool.decref([0])
    assert pool.allocate(2) == [1, 0]
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(2)
    pool.allocate(1)
    pool._ref_counts[1] = 1  # referenced while still on the free list
    with pytest.raises(AssertionError):
        pool.check_invariants()

    pool = BlockPool(2)
    pool.allocate(1)
    pool._hash_by_block[0] = H0  # one-sided hash map
    with pytest.raises(AssertionError):
        pool.check_invariants()
