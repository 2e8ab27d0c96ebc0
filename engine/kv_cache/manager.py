"""Per-request block tables over a BlockPool: what the scheduler uses, in tokens rather than blocks.

Prefix caching follows vLLM v1: full blocks whose KV has been computed are hashed as a chain and can be
shared read-only by later requests with the same prefix; the block holding a prompt's last token is always
computed fresh, so a shared block is never written. A request's `cache_salt` goes into its first block's
hash (engine.kv_cache.block_hash), so only requests with the same salt share blocks.

Under a sliding window (engine.kv_cache.window) the blocks no later query sees are freed as the
request advances: its table keeps their places, holding FREED, so block i still holds tokens
[i * block_size, (i + 1) * block_size). Freed blocks keep their hashes in the prefix cache (their KV
is still right for that prefix) until the pool reclaims them.

Under a KV budget (engine.kv_cache.kv_budget) the lowest-scoring blocks are freed the same way
(FREED), anywhere before the recent window. Only KV computed before a request's first eviction is
hashed: what later tokens computed depends on what was evicted, so it never enters the prefix
cache (nor the tiers and the gateway's index, which hear of hashed blocks only) under the hash a
full-attention block of the same tokens has. A reservation under a budget holds only the blocks
its prompt keeps: the sender picks them, and `place_kept` puts them where the table names them.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv_cache.block_hash import hash_block, prompt_block_hashes
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.kv_cache.kv_events import KVEvents
from engine.kv_cache.window import KVWindow

# A table entry whose block was freed (outside the window): never read, never written.
FREED = -1


@dataclass
class _RequestBlocks:
    """A request's block table and how far it is filled and hashed."""

    table: list[int] = field(default_factory=list)
    # Tokens the table covers: num_total_tokens of the last successful allocate_slots.
    num_tokens: int = 0
    # Chain hashes of table[:len(hashes)]; kept so cache_blocks only hashes new blocks.
    hashes: list[bytes] = field(default_factory=list)
    # Table entries before this index and past the sinks are FREED (sliding window).
    freed_until: int = 0
    # Under a KV budget: each held block's accumulated attention mass, by table index.
    scores: dict[int, float] = field(default_factory=dict)
    # Tokens computed when the budget first freed a block (None: never): later KV is not hashed.
    hashed_until: int | None = None

    def held(self) -> list[int]:
        """The blocks the request holds a reference on, in table order."""
        return [block_id for block_id in self.table if block_id != FREED]


class KVCacheManager:
    """Allocates, shares, caches and frees KV blocks for requests identified by string ids."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 salt: bytes = b"", events: KVEvents | None = None, window: KVWindow | None = None,
                 budget: KVBudget | None = None) -> None:
        """`events` hears of every block the prefix cache names or drops (tier "device")."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, events=events)
        self._block_size = block_size
        self._enable_prefix_caching = enable_prefix_caching
        self._salt = salt
        self._window = window
        self._budget = budget
        self._requests: dict[str, _RequestBlocks] = {}
        # Blocks newly hashed since `take_new_cached`, kept only for lower tiers (which copy them).
        self._new_cached: list[tuple[int, bytes]] | None = None

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def budget(self) -> KVBudget | None:
        """The KV budget requests are evicted under (None: none)."""
        return self._budget

    @property
    def num_blocks(self) -> int:
        """Total number of blocks."""
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation could take (free plus evictable cached blocks)."""
        return self._pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's kv_cache_usage_perc), 0..1."""
        return (self._pool.num_blocks - self._pool.num_free) / self._pool.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by prefix hash."""
        return self._pool.num_cached

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` has a block table."""
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (block ids in token order; FREED outside a window)."""
        return list(self._requests[request_id].table)

    def prefix_hashes(self, token_ids: Sequence[int], cache_salt: bytes = b"") -> list[bytes]:
        """Chain hashes of the blocks `find_cached_prefix` could return for `token_ids` (all full
        blocks but one holding the last token): what a lower tier is asked for."""
        max_blocks = max(0, (len(token_ids) - 1) // self._block_size)
        return prompt_block_hashes(token_ids[:max_blocks * self._block_size], self._block_size, self._salt,
                                   cache_salt)

    def track_new_cached(self) -> None:
        """From now on, remember each block newly hashed until `take_new_cached` hands it on."""
        self._new_cached = []

    def take_new_cached(self) -> list[tuple[int, bytes]]:
        """The blocks hashed since the last call (block id, chain hash) that still hold their hash."""
        if not self._new_cached:
            return []
        taken, self._new_cached = self._new_cached, []
        # A block hashed by a reservation's start may have been reclaimed since (its request ended).
        return [(block_id, block_hash) for block_id, block_hash in taken
                if self._pool.block_hash(block_id) == block_hash]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (its table less the entries freed outside a window)."""
        return len(self._requests[request_id].held())

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks that no query at `num_computed_tokens` or later sees (a no-op
        without a window). Call once those tokens are hashed (cache_blocks): a freed block stays
        findable by its hash until the pool reclaims it."""
        if self._window is None:
            return
        request = self._requests[request_id]
        unneeded = self._window.unneeded_blocks(num_computed_tokens, self._block_size)
        first = max(unneeded.start, request.freed_until)
        # A block is hashed before it goes, so cache_blocks never meets a FREED entry.
        stop = min(unneeded.stop, len(request.hashes)) if self._enable_prefix_caching else unneeded.stop
        # Head first, as `free` releases tails last: older blocks are reclaimed sooner.
        self._pool.decref(request.table[first:stop])
        for index in range(first, stop):
            request.table[index] = FREED
        request.freed_until = max(request.freed_until, stop)

    def add_scores(self, request_id: str, indices: Sequence[int], masses: Sequence[float]) -> None:
        """Add a step's attention mass to the request's blocks at table `indices`."""
        scores = self._requests[request_id].scores
        for index, mass in zip(indices, masses, strict=True):
            scores[index] = scores.get(index, 0.0) + mass

    def evict_over_budget(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the lowest-scoring blocks of a request whose first `num_computed_tokens` tokens are
        computed (all it knows but its next one), so that it holds at most the budget's blocks with
        its next token's slot (a no-op without a budget). Call after cache_blocks."""
        if self._budget is None:
            return
        request = self._requests[request_id]
        held = [index for index, block_id in enumerate(request.table) if block_id != FREED]
        victims = self._budget.victims(held, request.scores, num_computed_tokens)
        if not victims:
            return
        if request.hashed_until is None:
            request.hashed_until = num_computed_tokens
        self._pool.decref(request.table[index] for index in victims)
        for index in victims:
            request.table[index] = FREED
            request.scores.pop(index, None)

    def kept(self, request_id: str, budget: KVBudget, num_computed_tokens: int) -> tuple[KeptBlocks, list[int]]:
        """The blocks a request whose first `num_computed_tokens` tokens are computed would keep under
        `budget` were it evicted now (nothing is freed): which, and their block ids."""
        request = self._requests[request_id]
        held = [index for index, block_id in enumerate(request.table) if block_id != FREED]
        kept = budget.kept(held, request.scores, num_computed_tokens)
        return kept, [request.table[index] for index in kept.indices]

    def place_kept(self, request_id: str, kept: KeptBlocks) -> None:
        """Move a reservation's blocks (in table order) to the table indices `kept` names, with their
        scores, leaving the others FREED: its prompt arrived evicted under the budget. ValueError
        naming the field if `kept` does not name one index in the table for each block."""
        request = self._requests[request_id]
        blocks, size = request.held(), len(request.table)
        indices = list(kept.indices)
        if (len(indices) != len(blocks) or len(kept.scores) != len(blocks) or indices != sorted(set(indices))
                or not all(0 <= index < size for index in indices)):
            raise ValueError(f"kept_blocks: expected {len(blocks)} increasing table indices in [0, {size}) "
                             f"with a score each, got {len(indices)} ({len(kept.scores)} scores)")
        request.table = [FREED] * size
        for index, block_id in zip(indices, blocks, strict=True):
            request.table[index] = block_id
        request.scores = dict(zip(indices, kept.scores, strict=True))
        request.freed_until = 0
        if len(blocks) < size:  # evicted: what is computed from now on is not full-attention KV
            request.hashed_until = request.num_tokens

    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: bytes = b"") -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the start of ``token_ids``: (block ids, tokens covered).

        Read-only. At most ``(len(token_ids) - 1) // block_size`` blocks are returned so that at least the
        last token is computed (its logits are needed) and the block it lands in is private to the request.
        """
        if not self._enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (len(token_ids) - 1) // self._block_size)
        block_ids: list[int] = []
        parent: bytes | None = None
        for index in range(max_blocks):
            start = index * self._block_size
            parent = hash_block(parent, token_ids[start:start + self._block_size], self._salt,
                                cache_salt if index == 0 else b"")
            block_id = self._pool.lookup(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self._block_size

    def hidden_head(self, num_tokens: int) -> int:
        """Leading blocks that no query at `num_tokens` or later sees: a request whose first
        `num_tokens` tokens' KV arrives from elsewhere need neither hold nor receive them. 0 without
        a window, and with sinks (what they hide is not a head)."""
        if self._window is None or self._window.sink_tokens:
            return 0
        return len(self._window.unneeded_blocks(num_tokens, self._block_size))

    def allocate_slots(self, request_id: str, num_total_tokens: int, cached_blocks: Sequence[int] = (),
                       hidden_blocks: int = 0) -> bool:
        """Grow the request's table to cover ``num_total_tokens`` tokens; False (changing nothing) if out of blocks.

        ``cached_blocks`` (from ``find_cached_prefix``, called just before) are accepted only on a request's
        first call and become the head of its table; so are ``hidden_blocks`` FREED entries instead
        (``hidden_head``: never allocated, never read).
        """
        request = self._requests.get(request_id)
        if request is not None and (cached_blocks or hidden_blocks):
            raise ValueError(f"request {request_id!r} already has blocks; cached_blocks apply to its first call")
        if cached_blocks and hidden_blocks:
            raise ValueError("cached_blocks and hidden_blocks: a table's head is one or the other")
        if request is None:
            cached_hashes = self._hashes_of_cached(cached_blocks)
            held = len(cached_blocks) + hidden_blocks
            held_tokens = held * self._block_size
        else:
            held, held_tokens = len(request.table), request.num_tokens
        if num_total_tokens < held_tokens:
            raise ValueError(f"request {request_id!r} cannot shrink from {held_tokens} to {num_total_tokens} tokens")

        num_new = max(0, blocks_for(num_total_tokens, self._block_size) - held)
        # Evictable cached blocks count as free, but touching them below takes them out of the free count.
        reused_evictable = sum(1 for block_id in set(cached_blocks) if self._pool.ref_count(block_id) == 0)
        if num_new > self._pool.num_free - reused_evictable:
            return False

        if request is None:
            for block_id in cached_blocks:
                self._pool.touch(block_id)
            request = _RequestBlocks(table=list(cached_blocks) + [FREED] * hidden_blocks, hashes=cached_hashes,
                                     freed_until=hidden_blocks)
            self._requests[request_id] = request
        request.table.extend(self._pool.allocate(num_new))
        request.num_tokens = num_total_tokens
        return True

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                     cache_salt: bytes = b"") -> None:
        """Hash and register the request's blocks that are full within ``num_computed_tokens`` computed tokens.

        Call only once those tokens' KV is actually written. Incremental: already-hashed blocks are skipped.
        """
        if not self._enable_prefix_caching:
            return
        request = self._requests[request_id]
        if num_computed_tokens > min(request.num_tokens, len(token_ids)):
            raise ValueError(f"{num_computed_tokens} computed tokens exceed the request's "
                             f"{request.num_tokens} allocated or {len(token_ids)} known tokens")
        if request.hashed_until is not None:
            num_computed_tokens = min(num_computed_tokens, request.hashed_until)
        num_full = num_computed_tokens // self._block_size
        for index in range(len(request.hashes), num_full):
            start = index * self._block_size
            parent = request.hashes[-1] if request.hashes else None
            block_hash = hash_block(parent, token_ids[start:start + self._block_size], self._salt,
                                    cache_salt if index == 0 else b"")
            # A hidden head block (FREED) is chained through, never cached.
            if (request.table[index] != FREED and self._pool.register(request.table[index], block_hash)
                    and self._new_cached is not None):
                self._new_cached.append((request.table[index], block_hash))
            request.hashes.append(block_hash)

    def trim(self, request_id: str, num_total_tokens: int) -> None:
        """Shrink the request's table to cover `num_total_tokens` tokens, freeing the blocks past
        them (speculative decoding: slots of rejected drafts). Only unhashed blocks can go: hashed
        ones hold computed tokens, which are never taken back."""
        request = self._requests[request_id]
        if num_total_tokens > request.num_tokens:
            raise ValueError(f"request {request_id!r} cannot trim from {request.num_tokens} "
                             f"to {num_total_tokens} tokens")
        keep = blocks_for(num_total_tokens, self._block_size)
        if keep < len(request.hashes):
            raise ValueError(f"request {request_id!r}: trimming to {num_total_tokens} tokens would drop hashed blocks")
        self._pool.decref(reversed(request.table[keep:]))
        del request.table[keep:]
        request.num_tokens = num_total_tokens

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first so shared heads stay cached longest; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._pool.decref(reversed(request.held()))

    def check_invariants(self) -> None:
        """Raise AssertionError if pool or request bookkeeping is inconsistent."""
        self._pool.check_invariants()
        holders = Counter(block_id for request in self._requests.values() for block_id in request.held())
        for block_id in range(self._pool.num_blocks):
            assert self._pool.ref_count(block_id) == holders[block_id], f"block {block_id} ref count != holders"
        for request_id, request in self._requests.items():
            assert len(request.table) == blocks_for(request.num_tokens, self._block_size), f"{request_id}: table size"
            assert len(request.hashes) <= len(request.table), f"{request_id}: more hashes than blocks"
            for block_id, block_hash in zip(request.table[:len(request.hashes)], request.hashes, strict=True):
                assert block_id == FREED or self._pool.block_hash(block_id) in (None, block_hash), (
                    f"{request_id}: block hash mismatch")

    def _hashes_of_cached(self, cached_blocks: Sequence[int]) -> list[bytes]:
        if len(set(cached_blocks)) != len(cached_blocks):
            raise ValueError("cached_blocks contains a block twice")
        hashes = []
        for block_id in cached_blocks:
            block_hash = self._pool.block_hash(block_id)
            if block_hash is None:
                raise ValueError(f"cached block {block_id} is no longer cached")
            hashes.append(block_hash)
        return hashes
