"""The scheduler's side of loading a prompt's prefix back from a lower KV tier (engine.kv_tiers),
overlapped with computing the rest of the prompt (as vLLM's layer-wise KV connector loads, with
`wait_for_layer_load`).

When a waiting request's prefix continues past the blocks the device cache holds into blocks a lower
tier holds, the scheduler admits it at once as if those tokens were cached: it gets blocks for them
and for its first chunk, and its chunk runs in the same step. The mover's thread
(engine.kv_connector.tier_mover) writes the loaded blocks layer by layer under a KV connector
reservation, and the step's forward waits before each layer's attention until that layer is written
(engine.engine.Engine.step). When the step ends, the load has ended too: a load that wrote every
layer registers its blocks in the prefix cache (`finish`); one that failed (a block gone from its
tier, a layer that failed its check) discards the step's result for the request, which is rewound
to its device prefix hit and recomputes the rest (`fail`, then engine.scheduler.Scheduler.rewind), before the
scheduler's update can hash a block it computed over pages that never came. Ending the reservation
before anything else keeps a late write out of blocks the request recomputes or that change owner.
No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.kv_cache.manager import KVCacheManager
from engine.kv_connector.scheduler_side import KVConnectorScheduler
from engine.request import Request

# A load is local bytes: a step waits at most this long for one before it counts as failed.
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
    """The requests whose prefix is loading from a lower tier in this step."""

    def __init__(self, kv: KVCacheManager, connector: KVConnectorScheduler, loads: TierLoads) -> None:
        self._kv = kv
        self._connector = connector
        self._loads = loads
        self.tickets: dict[str, int] = {}  # request id -> its load's reservation ticket
        self._blocks: dict[str, tuple[int, int]] = {}  # request id -> (blocks the device held, blocks loading)
        self._failed: set[str] = set()  # requests whose load failed: they recompute without the tiers
        # Prompt tokens looked up in the lower tiers, and loaded back (vLLM's external prefix cache).
        self.queried_tokens = 0
        self.hit_tokens = 0

    def lookup(self, request: Request, num_cached_blocks: int) -> int:
        """How many blocks after the request's device prefix hit the lower tiers hold."""
        if request.request_id in self._failed:
            return 0
        hashes = self._kv.prefix_hashes(request.token_ids, request.first_block_key)[num_cached_blocks:]
        if not hashes:
            return 0
        self.queried_tokens += len(hashes) * self._kv.block_size
        return self._loads.available(hashes)

    def start(self, request: Request, num_cached_blocks: int, count: int) -> None:
        """Load `count` blocks after the device prefix hit into the blocks the request was allocated
        for them (it runs in this step as if they were cached)."""
        hashes = self._kv.prefix_hashes(request.token_ids, request.first_block_key)[num_cached_blocks:]
        to_fill = self._kv.block_table(request.request_id)[num_cached_blocks:num_cached_blocks + count]
        ticket = self._connector.reserved(request.request_id, to_fill, LOAD_TIMEOUT_S)
        self.tickets[request.request_id] = ticket
        self._blocks[request.request_id] = (num_cached_blocks, count)
        self._loads.load(request.request_id, ticket, to_fill, hashes[:count])

    def finish(self, request: Request) -> None:
        """The request's load wrote every layer: its blocks join the prefix cache."""
        self.tickets.pop(request.request_id)
        self._connector.end(request.request_id)
        _, count = self._blocks.pop(request.request_id)
        self.hit_tokens += count * self._kv.block_size
        self._kv.cache_blocks(request.request_id, request.token_ids, request.num_computed_tokens,
                              request.first_block_key)

    def fail(self, request_id: str) -> int:
        """The request's load failed: no write lands after this, and a retry leaves the tiers alone.
        The tokens its device prefix hit held (what it computed before the load's blocks)."""
        self.tickets.pop(request_id)
        num_cached_blocks, _ = self._blocks.pop(request_id)
        self._connector.end(request_id)
        self._failed.add(request_id)
        return num_cached_blocks * self._kv.block_size

    def discard(self, request_id: str) -> None:
        """The request ended (its reservation, if any, ends with it)."""
        self.tickets.pop(request_id, None)
        self._blocks.pop(request_id, None)
        self._failed.discard(request_id)
