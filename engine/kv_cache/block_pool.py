"""Ownership of KV blocks: free list, reference counts, and the prefix cache of hashed full blocks.

Every block is in exactly one state:

- free: never hashed (or hash dropped); in a FIFO free list, handed out first.
- evictable: hashed but unreferenced; still findable by hash, kept in LRU order of when it was freed and
  reclaimed (losing its hash) only once the free list is empty, so cached prefixes live as long as possible.
- referenced: ref count > 0, held by one or more requests' block tables.

With `events`, a block named by a hash is reported stored on the "device" tier, and one whose hash is
dropped (reclaimed) removed: the gateway's exact prefix index follows them (engine.kv_cache.kv_events).
"""

from collections import OrderedDict, deque
from collections.abc import Iterable

from engine.kv_cache.kv_events import KVEvents


class BlockPool:
    """Pure bookkeeping over block ids ``0 .. num_blocks - 1``; the KV tensors live elsewhere."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEvents | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_blocks = num_blocks
        self._enable_caching = enable_caching
        self._events = events
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}

    @property
    def num_blocks(self) -> int:
        """Total number of blocks in the pool."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks obtainable by ``allocate``: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a hash (referenced or evictable)."""
        return len(self._hash_by_block)

    def ref_count(self, block_id: int) -> int:
        """Number of references currently held on ``block_id``."""
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash registered for ``block_id``, or None if it has none."""
        return self._hash_by_block.get(block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """Block id holding the content with ``block_hash``, or None; does not take a reference."""
        return self._block_by_hash.get(block_hash)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks with ref count 1, or return None (changing nothing) if fewer are obtainable.

        Plain free blocks go first (FIFO); only then are evictable blocks reclaimed, least recently freed first.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_free:
            return None
        block_ids = []
        dropped = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                dropped.append(self._hash_by_block.pop(block_id))
                del self._block_by_hash[dropped[-1]]
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        if dropped and self._events is not None:
            self._events.removed("device", dropped)
        return block_ids

    def touch(self, block_id: int) -> None:
        """Take a reference on a cached block found by ``lookup``, pulling it out of the LRU if it was evictable."""
        if block_id not in self._hash_by_block:
            raise ValueError(f"block {block_id} is not cached")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order; unreferenced blocks become evictable or free."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} has no reference to drop")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._hash_by_block:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Record that referenced, full ``block_id`` holds the content named by ``block_hash``; whether
        it newly did.

        If another block already holds that hash the first mapping wins and ``block_id`` stays unhashed:
        the duplicate is freed normally and the prefix cache keeps one copy. A no-op without caching.
        """
        if not self._enable_caching:
            return False
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is unreferenced and cannot be registered")
        current = self._hash_by_block.get(block_id)
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already registered under a different hash")
            return False
        if block_hash in self._block_by_hash:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        if self._events is not None:
            self._events.stored("device", [block_hash])
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        free = set(self._free)
        evictable = set(self._evictable)
        referenced = {b for b, count in enumerate(self._ref_counts) if count > 0}
        assert len(self._ref_counts) == self._num_blocks, "ref count table has the wrong size"
        assert all(count >= 0 for count in self._ref_counts), "negative ref count"
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & evictable and not free & referenced and not evictable & referenced, "block in two states"
        assert free | evictable | referenced == set(range(self._num_blocks)), "block in no state"
        assert not free & self._hash_by_block.keys(), "hashed block in the free list"
        assert evictable <= self._hash_by_block.keys(), "unhashed block in the evictable LRU"
        assert len(self._block_by_hash) == len(self._hash_by_block), "hash maps differ in size"
        assert all(self._hash_by_block.get(b) == h for h, b in self._block_by_hash.items()), "hash maps disagree"
        assert self._enable_caching or not self._hash_by_block, "hashed block with caching disabled"
