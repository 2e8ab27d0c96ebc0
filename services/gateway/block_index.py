"""Which worker holds which KV block in which tier, exactly, from the block events the workers' load
reports carry (engine.kv_cache.kv_events). Imports neither grpc nor torch.

Blocks are named by the workers' own chain hashes (engine.kv_cache.block_hash, salted with each
worker's reported salt), so a prompt hashed here with that salt finds exactly the blocks the worker's
prefix cache would. A worker's device and disk tiers are its own; its host tier is shared by the
workers of a node attached to it (its `host_tier_id`), so a block any of them put there counts as
held by each: any of them can load it back. A reset (a stream's first report, or one that fell
behind the worker's event log) replaces what the worker had said; a worker gone, restarted or
refused for its reports is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache.kv_events import TIERS, Tier


@dataclass(frozen=True)
class TierEvent:
    """Blocks one of a worker's tiers stored (or, `stored` False, dropped)."""

    tier: Tier
    stored: bool
    block_hashes: Sequence[bytes]


@dataclass(frozen=True)
class PrefixHit:
    """The leading blocks of a prompt a worker can use, by the tier each comes from (the fastest
    that holds it); the run ends at the first block no tier holds."""

    blocks: dict[Tier, int] = field(default_factory=dict)

    @property
    def device_blocks(self) -> int:
        return self.blocks.get("device", 0)

    @property
    def lower_blocks(self) -> dict[Tier, int]:
        """The blocks to load back from the tiers below the device."""
        return {tier: count for tier, count in self.blocks.items() if tier != "device" and count}


@dataclass
class _Worker:
    host_tier_id: str = ""
    held: dict[Tier, set[bytes]] = field(default_factory=lambda: {tier: set() for tier in TIERS})


class BlockIndex:
    """Per worker (by address), the blocks each of its tiers holds, as its events said."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}

    def apply(self, address: str, host_tier_id: str, events: Iterable[TierEvent], reset: bool) -> None:
        """A worker's events since its last report, or (`reset`) all it holds."""
        worker = self._workers.get(address)
        if worker is None or reset:
            worker = self._workers[address] = _Worker()
        worker.host_tier_id = host_tier_id
        for event in events:
            held = worker.held[event.tier]
            if event.stored:
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)

    def forget(self, address: str) -> None:
        """The worker is gone, restarted, or its reports are not to be believed."""
        self._workers.pop(address, None)

    def counts(self, address: str) -> dict[Tier, int]:
        """How many blocks each of the worker's tiers holds, as its events said (its own host-tier
        reports only)."""
        worker = self._workers.get(address)
        return {tier: len(held) for tier, held in worker.held.items()} if worker is not None else {}

    @property
    def size(self) -> int:
        """Block entries held, over every worker and tier."""
        return sum(len(held) for worker in self._workers.values() for held in worker.held.values())

    def prefix(self, address: str, hashes: Sequence[bytes]) -> PrefixHit:
        """Which tiers the worker at `address` can take the prompt's leading blocks (`hashes`, hashed
        with its salt) from."""
        worker = self._workers.get(address)
        if worker is None:
            return PrefixHit()
        host = self._host_sets(address, worker)
        counts: dict[Tier, int] = {}
        for block_hash in hashes:
            tier = _fastest(block_hash, worker, host)
            if tier is None:
                break
            counts[tier] = counts.get(tier, 0) + 1
        return PrefixHit(counts)

    def _host_sets(self, address: str, worker: _Worker) -> list[set[bytes]]:
        """The host-tier sets `worker` can load from: its own, or every one reported for its shared tier."""
        if not worker.host_tier_id:
            return [worker.held["host"]]
        return [other.held["host"] for other in self._workers.values() if other.host_tier_id == worker.host_tier_id]


def _fastest(block_hash: bytes, worker: _Worker, host: list[set[bytes]]) -> Tier | None:
    if block_hash in worker.held["device"]:
        return "device"
    if any(block_hash in held for held in host):
        return "host"
    if block_hash in worker.held["disk"]:
        return "disk"
    return None
