"""The scheduler's side of loading a prompt's prefix back from a lower KV tier (engine.kv_tiers).

When a waiting request's prefix continues past the blocks the device cache holds into blocks a lower
tier holds, it gets blocks for them at once and waits (RequestStatus.WAITING_FOR_KV) while the
mover's thread (engine.kv_connector.tier_mover) loads them, other requests stepping meanwhile. The
load writes under a KV connector reservation, like pages from a prefill worker, so a request aborted
or expired mid-load frees blocks no late write can touch (engine.kv_connector.connector). When the
load ends the request runs from there: what arrived is registered in the prefix cache and counted
as computed, and a block that did not arrive (a miss, a damaged record) is computed like any other.
No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.kv_cache.manager import KVCacheManager
from engine.kv_connector.scheduler_side import KVConnectorScheduler
from engine.request import Request, RequestStatus

# A load is local bytes: if it has not ended by then, something is stuck, and the request's blocks go.
LOAD_TIMEOUT_S = 60.0


class TierLoads(Protocol):
    """What the scheduler asks of the lower tiers (engine.kv_connector.tier_mover.TierMover)."""

    def available(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, a lower tier holds."""
        ...

    def load(self, request_id: str, ticket: int, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """Start loading those blocks into `block_ids` under the reservation `ticket`."""
        ...


class TierLoading:
    """The requests waiting for their prefix from a lower tier."""

    def __init__(self, kv: KVCacheManager, connector: KVConnectorScheduler, loads: TierLoads) -> None:
        self._kv = kv
        self._connector = connector
        self._loads = loads
        self.requests: dict[str, Request] = {}
        self._expected: dict[str, int] = {}
        self._holding_all: set[str] = set()  # requests whose blocks cover every token, kept whatever loads
        # Prompt tokens looked up in the lower tiers, and loaded back (vLLM's external prefix cache).
        self.queried_tokens = 0
        self.hit_tokens = 0

    def start(self, request: Request, cached_blocks: list[int], num_cached: int, hold_all: bool = False) -> bool:
        """Start loading what lower tiers hold after the request's device prefix hit; False (nothing
        changed) when they hold none of it or the blocks cannot be had now. `hold_all`: the request
        gets blocks for all its tokens at once, not only the loaded ones (an export that must never
        wait for blocks: engine.scheduler.Scheduler.admit_export)."""
        hashes = self._kv.prefix_hashes(request.token_ids, request.cache_salt)[len(cached_blocks):]
        if not hashes:
            return False
        count = self._loads.available(hashes)
        self.queried_tokens += len(hashes) * self._kv.block_size
        if count == 0:
            return False
        total = num_cached + count * self._kv.block_size
        if not self._kv.allocate_slots(request.request_id, request.num_tokens if hold_all else total,
                                       cached_blocks):
            return False
        to_fill = self._kv.block_table(request.request_id)[len(cached_blocks):len(cached_blocks) + count]
        ticket = self._connector.reserved(request.request_id, to_fill, LOAD_TIMEOUT_S)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self._expected[request.request_id] = count
        if hold_all:
            self._holding_all.add(request.request_id)
        self._loads.load(request.request_id, ticket, to_fill, hashes[:count])
        return True

    def finish(self, request_id: str, blocks_loaded: int) -> Request | None:
        """A load ended with its first `blocks_loaded` blocks written: the request, ready to run
        from there (None if it ended meanwhile)."""
        request = self.requests.pop(request_id, None)
        expected = self._expected.pop(request_id, 0)
        holding_all = request_id in self._holding_all
        self._holding_all.discard(request_id)
        if request is None:
            return None
        self._connector.end(request_id)  # no write lands in a block a step computes with
        computed = request.num_computed_tokens + blocks_loaded * self._kv.block_size
        if blocks_loaded < expected and not holding_all:
            self._kv.trim(request_id, computed)
        request.num_computed_tokens = computed
        self.hit_tokens += blocks_loaded * self._kv.block_size
        if request.num_preemptions == 0:
            request.num_cached_tokens = computed
        self._kv.cache_blocks(request_id, request.token_ids, computed, request.cache_salt)
        request.status = RequestStatus.RUNNING
        return request

    def discard(self, request_id: str) -> None:
        """The request ended while loading (its reservation ends with it)."""
        self.requests.pop(request_id, None)
        self._expected.pop(request_id, None)
        self._holding_all.discard(request_id)
