"""KVCacheManager and block hashing: hand-checked block ids, then a stateful property test with a shadow KV."""

from dataclasses import dataclass

import pytest
from fuzzing import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache.block_hash import hash_block, prompt_block_hashes
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.manager import KVCacheManager

BS = 4


def computed(manager: KVCacheManager, request_id: str, token_ids: list[int]) -> None:
    """Allocate and 'compute' the whole token list in one step, registering its full blocks."""
    assert manager.allocate_slots(request_id, len(token_ids))
    manager.cache_blocks(request_id, token_ids, len(token_ids))


# --- hashing ---------------------------------------------------------------------------------------------

def test_hash_format_is_pinned():
    root = hash_block(None, [1, 2, 3, 4])
    assert root.hex() == "97f32c45c64f8f9f0bbe62c88594d2b39adea55ccccef94824c561ee24b7ae6c"
    assert hash_block(root, [5, 6, 7, 8], b"model-a").hex() == (
        "3ef405f5452a9dad6c7f378583c7195e86aecc450d7c3e663f34de4eed174a1a")


def test_hash_depends_on_parent_salt_and_tokens():
    base = hash_block(None, [1, 2, 3, 4])
    assert hash_block(base, [1, 2, 3, 4]) != base
    assert hash_block(None, [1, 2, 3, 4], b"x") != base
    assert hash_block(None, [1, 2, 3, 5]) != base
    # The salt length is hashed, so salt bytes cannot pose as token bytes.
    assert hash_block(None, [1], b"") != hash_block(None, [], (1).to_bytes(8, "little"))
    with pytest.raises(ValueError):
        hash_block(b"short", [1])


def test_prompt_block_hashes_chain_full_blocks_only():
    tokens = list(range(11))
    hashes = prompt_block_hashes(tokens, BS, b"s")
    first = hash_block(None, tokens[0:4], b"s")
    assert hashes == [first, hash_block(first, tokens[4:8], b"s")]
    assert prompt_block_hashes(tokens[:3], BS) == []




# --- allocation, prefix hits, eviction --------------------------------------------------------------------

def test_allocate_slots_grows_table_in_whole_blocks():
    manager = KVCacheManager(4, BS)
    assert manager.allocate_slots("a", 10)
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.num_free_blocks == 1
    assert manager.usage == 0.75
    assert manager.allocate_slots("a", 12)
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.allocate_slots("a", 13)
    assert manager.block_table("a") == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        manager.allocate_slots("a", 12)
    manager.check_invariants()


def test_allocate_failure_leaves_state_unchanged():
    manager = KVCacheManager(4, BS)
    assert manager.allocate_slots("a", 10)
    assert not manager.allocate_slots("b", 8)
    assert not manager.has_request("b")
    assert not manager.allocate_slots("a", 17)
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.num_free_blocks == 1
    manager.check_invariants()


def test_block_table_is_a_copy():
    manager = KVCacheManager(4, BS)
    manager.allocate_slots("a", 4)
    manager.block_table("a").append(3)
    assert manager.block_table("a") == [0]


def test_prefix_hit_returns_the_very_blocks_and_shares_them():
    manager = KVCacheManager(8, BS)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    computed(manager, "a", prompt)
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.num_cached_blocks == 2

    other = [*prompt[:8], 99, 98]
    blocks, num_tokens = manager.find_cached_prefix(other)
    assert (blocks, num_tokens) == ([0, 1], 8)
    assert manager.allocate_slots("b", len(other), blocks)
    assert manager.block_table("b") == [0, 1, 3]
    assert manager.num_free_blocks == 4
    manager.check_invariants()
    # Only the shared prefix is reused; a diverging second block misses.
    assert manager.find_cached_prefix([*prompt[:4], 0, 0, 0, 0, 1]) == ([0], 4)


def test_prefix_hit_leaves_the_last_token_to_compute():
    manager = KVCacheManager(8, BS)
    computed(manager, "a", list(range(12)))
    assert manager.find_cached_prefix(list(range(12))) == ([0, 1], 8)
    assert manager.find_cached_prefix(list(range(9))) == ([0, 1], 8)
    assert manager.find_cached_prefix(list(range(8))) == ([0], 4)
    assert manager.find_cached_prefix([0]) == ([], 0)
    assert manager.find_cached_prefix([]) == ([], 0)


def test_free_releases_tail_first_so_lru_evicts_tail_first():
    manager = KVCacheManager(4, BS)
    prompt = list(range(12))
    computed(manager, "a", prompt)
    manager.free("a")
    assert manager.num_free_blocks == 4
    assert manager.num_cached_blocks == 3
    assert manager.usage == 0.0
    assert not manager.has_request("a")

    assert manager.allocate_slots("x", 4)
    assert manager.block_table("x") == [3]
    assert manager.find_cached_prefix([*prompt, 0]) == ([0, 1, 2], 12)
    assert manager.allocate_slots("x", 8)
    assert manager.block_table("x") == [3, 2]
    assert manager.find_cached_prefix([*prompt, 0]) == ([0, 1], 8)
    assert manager.allocate_slots("x", 12)
    assert manager.block_table("x") == [3, 2, 1]
    assert manager.find_cached_prefix([*prompt, 0]) == ([0], 4)
    manager.check_invariants()


def test_evictable_cached_blocks_do_not_count_twice():
    manager = KVCacheManager(4, BS)
    prompt = list(range(12))
    computed(manager, "a", prompt)
    manager.free("a")

    longer = [*prompt, 1, 2, 3, 4, 5]
    blocks, _ = manager.find_cached_prefix(longer)
    assert blocks == [0, 1, 2]
    # 5 blocks needed: 3 reused plus 2 new, but touching the 3 evictable ones leaves only 1 obtainable.
    assert not manager.allocate_slots("b", len(longer), blocks)
    assert manager.num_free_blocks == 4
    assert manager.num_cached_blocks == 3
    manager.check_invariants()

    fits = [*prompt, 1, 2, 3, 4]
    blocks, _ = manager.find_cached_prefix(fits)
    assert manager.allocate_slots("b", len(fits), blocks)
    assert manager.block_table("b") == [0, 1, 2, 3]
    assert manager.usage == 1.0
    manager.check_invariants()


def test_cached_blocks_only_on_first_call_and_must_still_be_cached():
    manager = KVCacheManager(4, BS)
    computed(manager, "a", list(range(5)))
    with pytest.raises(ValueError):
        manager.allocate_slots("a", 8, [0])
    with pytest.raises(ValueError):
        manager.allocate_slots("b", 8, [1])
    with pytest.raises(ValueError):
        manager.allocate_slots("b", 3, [0])
    assert not manager.has_request("b")
    manager.check_invariants()


def test_cache_blocks_is_incremental_and_bounded_by_allocation():
    manager = KVCacheManager(8, BS)
    tokens = list(range(10))
    assert manager.allocate_slots("a", 6)
    manager.cache_blocks("a", tokens, 3)
    assert manager.num_cached_blocks == 0
    manager.cache_blocks("a", tokens, 6)
    assert manager.num_cached_blocks == 1
    with pytest.raises(ValueError):
        manager.cache_blocks("a", tokens, 7)
    assert manager.allocate_slots("a", 10)
    manager.cache_blocks("a", tokens, 10)
    assert manager.num_cached_blocks == 2
    assert manager.find_cached_prefix(tokens) == ([0, 1], 8)


def test_concurrent_identical_prompts_cache_one_copy():
    manager = KVCacheManager(8, BS)
    tokens = list(range(9))
    computed(manager, "a", tokens)
    computed(manager, "b", tokens)
    assert manager.block_table("b") == [3, 4, 5]
    assert manager.num_cached_blocks == 2
    manager.free("b")
    manager.free("a")
    # b's duplicates went to the free list, so the next allocation takes them before any cached block.
    assert manager.allocate_slots("c", 16)
    assert manager.block_table("c") == [6, 7, 5, 4]
    assert manager.find_cached_prefix(tokens) == ([0, 1], 8)
    manager.check_invariants()


def test_prefix_caching_disabled():
    manager = KVCacheManager(8, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    computed(manager, "a", tokens)
    assert manager.num_cached_blocks == 0
    assert manager.find_cached_prefix(tokens) == ([], 0)
    manager.free("a")
    assert manager.num_free_blocks == 8


# --- freeing and invariant checking ----------------------------------------------------------------------

def test_freeing_an_unknown_request_changes_nothing():
    manager = KVCacheManager(4, BS)
    manager.allocate_slots("a", 4)
    manager.free("missing")
    assert manager.has_request("a") and manager.num_free_blocks == 3
    manager.check_invariants()


def test_check_invariants_detects_ref_count_drift():
    manager = KVCacheManager(4, BS)
    manager.allocate_slots("a", 4)
    manager._pool.allocate(1)  # a reference no request table accounts for
    with pytest.raises(AssertionError):
        manager.check_invariants()


# --- stateful property test ------------------------------------------------------------------------------

SHARED_PREFIXES = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [0] * 16, [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])


@dataclass
class SimRequest:
    tokens: list[int]
    num_computed: int


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler and a runner would, keeping a shadow of every block's contents.

    The shadow catches what bookkeeping checks alone cannot: a shared block written in place, or a prefix
    hit on a block whose content changed.
    """

    NUM_BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(self.NUM_BLOCKS, BS, salt=b"fingerprint")
        self.requests: dict[str, SimRequest] = {}
        self.kv: dict[int, list[int | None]] = {b: [None] * BS for b in range(self.NUM_BLOCKS)}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _snapshot(self) -> tuple:
        manager = self.manager
        tables = {rid: manager.block_table(rid) for rid in self.requests}
        hits = {rid: manager.find_cached_prefix(sim.tokens) for rid, sim in self.requests.items()}
        return manager.num_free_blocks, manager.num_cached_blocks, manager.usage, tables, hits

    def _compute(self, request_id: str, target: int) -> None:
        """The runner: write KV for the new tokens, then register full blocks."""
        sim = self.requests[request_id]
        table = self.manager.block_table(request_id)
        for pos in range(sim.num_computed, target):
            self.kv[table[pos // BS]][pos % BS] = sim.tokens[pos]
        sim.num_computed = target
        self.manager.cache_blocks(request_id, sim.tokens, target)

    @rule(prefix=st.sampled_from(SHARED_PREFIXES), prefix_len=st.integers(0, 16),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=10), chunk=st.integers(1, 24))
    def new_request(self, prefix: list[int], prefix_len: int, tail: list[int], chunk: int) -> None:
        tokens = prefix[:prefix_len] + tail
        blocks, num_cached = self.manager.find_cached_prefix(tokens)
        assert num_cached == len(blocks) * BS < len(tokens)
        for index, block_id in enumerate(blocks):
            assert self.kv[block_id] == tokens[index * BS:(index + 1) * BS]
        target = min(len(tokens), num_cached + chunk)
        before = self._snapshot()
        request_id = self._new_id()
        if not self.manager.allocate_slots(request_id, target, blocks):
            assert self._snapshot() == before
            return
        assert self.manager.block_table(request_id)[:len(blocks)] == blocks
        self.requests[request_id] = SimRequest(tokens, num_cached)
        self._compute(request_id, target)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=st.integers(1, 24), new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=3),
          preempt_on_failure=st.booleans())
    def step(self, data: st.DataObject, chunk: int, new_tokens: list[int], preempt_on_failure: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        sim = self.requests[request_id]
        decoding = sim.num_computed == len(sim.tokens)
        if decoding:
            sim.tokens.extend(new_tokens)
        target = min(len(sim.tokens), sim.num_computed + chunk)
        before = self._snapshot()
        if self.manager.allocate_slots(request_id, target):
            self._compute(request_id, target)
            return
        assert self._snapshot() == before
        if decoding:
            del sim.tokens[-len(new_tokens):]
        if preempt_on_failure:
            self.free(data)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.manager.free(request_id)
        del self.requests[request_id]
        assert not self.manager.has_request(request_id)

    @invariant()
    def bookkeeping_and_contents_agree(self) -> None:
        self.manager.check_invariants()
        held = set()
        for request_id, sim in self.requests.items():
            table = self.manager.block_table(request_id)
            held.update(table)
            assert len(table) == blocks_for(sim.num_computed, BS)
            for pos in range(sim.num_computed):
                assert self.kv[table[pos // BS]][pos % BS] == sim.tokens[pos], f"{request_id} KV corrupted at {pos}"
        assert self.manager.usage == len(held) / self.NUM_BLOCKS

    def teardown(self) -> None:
        for request_id in list(self.requests):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == self.NUM_BLOCKS
        assert self.manager.usage == 0


KVCacheMachine.TestCase.settings = settings(max_examples=examples(200), stateful_step_count=30, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


def test_a_cache_salt_keeps_tenants_prefixes_apart():
    kv = KVCacheManager(num_blocks=8, block_size=BS, salt=b"model")
    prompt = list(range(9))
    assert kv.allocate_slots("a", 9)
    kv.cache_blocks("a", prompt, 9, cache_salt=b"tenant-a")
    assert kv.find_cached_prefix(prompt, b"tenant-a")[1] == 8
    assert kv.find_cached_prefix(prompt, b"tenant-b") == ([], 0)
    assert kv.find_cached_prefix(prompt) == ([], 0)  # no salt is a tenant of its own
    salted = prompt_block_hashes(prompt, BS, b"model", cache_salt=b"tenant-a")
    plain = prompt_block_hashes(prompt, BS, b"model")
    assert salted[0] == hash_block(None, prompt[:4], b"model", b"tenant-a") != plain[0]
    assert salted[1] == hash_block(salted[0], prompt[4:8], b"model")  # only the first block carries it
    with pytest.raises(ValueError, match="cache_salt"):
        hash_block(salted[0], prompt[4:8], b"model", b"tenant-a")


# --- a sliding window ------------------------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_a_window_frees_the_blocks_behind_it_and_keeps_their_places(caching):
    from engine.kv_cache.manager import FREED
    from engine.kv_cache.window import KVWindow

    manager = KVCacheManager(8, BS, enable_prefix_caching=caching, window=KVWindow(6, sink_tokens=BS))
    tokens = list(range(20))
    computed(manager, "a", tokens)
    # A query at 20 or later sees 15..20 and the sink block 0: blocks 1, 2 (tokens 4..11) go; 3 (12..15) stays.
    manager.free_outside_window("a", 20)
    assert manager.block_table("a") == [0, FREED, FREED, 3, 4]
    assert manager.num_held_blocks("a") == 3 and manager.num_free_blocks == 5
    manager.check_invariants()
    # Growing appends after the freed places; freeing again is idempotent; freeing all skips them.
    assert manager.allocate_slots("a", 21)
    manager.free_outside_window("a", 20)
    assert manager.block_table("a")[:3] == [0, FREED, FREED] and len(manager.block_table("a")) == 6
    manager.check_invariants()
    manager.free("a")
    assert manager.num_free_blocks == 8
    manager.check_invariants()
    # The freed blocks kept their hashes: the whole prefix is a hit until the pool reclaims them.
    assert manager.find_cached_prefix(tokens)[1] == (16 if caching else 0)


def test_a_block_is_freed_only_once_hashed():
    from engine.kv_cache.window import KVWindow

    manager = KVCacheManager(8, BS, window=KVWindow(2))
    assert manager.allocate_slots("a", 12)
    manager.free_outside_window("a", 12)  # nothing hashed yet: nothing goes
    assert manager.num_held_blocks("a") == 3
    manager.cache_blocks("a", list(range(12)), 12)
    manager.free_outside_window("a", 12)
    assert manager.num_held_blocks("a") == 1


def test_a_hidden_head_is_never_held_and_chained_through_but_never_cached():
    from engine.kv_cache.manager import FREED
    from engine.kv_cache.window import KVWindow

    manager = KVCacheManager(8, BS, window=KVWindow(5))
    tokens = list(range(14))
    # A query at 14 sees 10..14: blocks 0 and 1 (tokens 0..7) are hidden.
    assert manager.hidden_head(14) == 2 and KVCacheManager(8, BS).hidden_head(14) == 0
    assert KVCacheManager(8, BS, window=KVWindow(5, sink_tokens=BS)).hidden_head(14) == 0
    assert manager.allocate_slots("a", 14, hidden_blocks=2)
    assert manager.block_table("a")[:2] == [FREED, FREED] and manager.num_held_blocks("a") == 2
    manager.cache_blocks("a", tokens, 14)
    manager.free_outside_window("a", 14)
    manager.check_invariants()
    assert manager.num_cached_blocks == 1  # block 2 (tokens 8..11), under its whole-prefix hash
    manager.free("a")
    assert manager.find_cached_prefix(tokens) == ([], 0)  # the chain's head was never here
    manager.check_invariants()
