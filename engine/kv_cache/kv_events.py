"""The engine's KV block events: which blocks (by chain hash, engine.kv_cache.block_hash) each tier
stores and drops, for the gateway's exact prefix index. No torch.

Every tier (the device pool, and the host and disk tiers below it) reports here from its own thread.
KVEvents keeps a bounded log of those events, numbered, and the set of blocks each tier holds now. A
load-report stream reads the log from its own cursor; a stream that starts, or whose cursor fell out
of the log, gets a snapshot of the sets instead (as in vLLM's KV events, where a subscriber that
missed events asks for a replay, and in Dynamo's indexer, which rebuilds a worker from a dump).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Tier = Literal["device", "host", "disk"]
TIERS: tuple[Tier, ...] = ("device", "host", "disk")

# Events kept for streams that fall behind; a stream further behind gets a snapshot. An event is one
# report of a tier (the device pool reports each block it names or drops): a 200 ms report interval
# sees a few hundred at most.
DEFAULT_MAX_EVENTS = 65536
# Recent load-backs the mean load time per block is taken over, per tier.
_LOAD_SAMPLES = 32


@dataclass(frozen=True)
class BlockEvent:
    """Blocks a tier stored (or, `stored` False, dropped), numbered in the order reported."""

    seq: int
    tier: Tier
    stored: bool
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class EventBatch:
    """What a stream sends next: `events` since its cursor or, `reset`, the tiers' whole holdings as
    stored events (the receiver drops what it knew first); `cursor` is where the stream reads next."""

    events: tuple[BlockEvent, ...]
    reset: bool
    cursor: int


class KVEvents:
    """Block events of every tier, their bounded log and the blocks each tier holds. Thread-safe."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events: must be positive, got {max_events}")
        self._lock = threading.Lock()
        self._log: deque[BlockEvent] = deque(maxlen=max_events)
        self._next_seq = 0
        self._held: dict[Tier, set[bytes]] = {tier: set() for tier in TIERS}
        self._loads: dict[Tier, deque[tuple[int, float]]] = {}

    def stored(self, tier: Tier, block_hashes: Sequence[bytes]) -> None:
        """`tier` now holds these blocks."""
        self._append(tier, True, block_hashes)

    def removed(self, tier: Tier, block_hashes: Sequence[bytes]) -> None:
        """`tier` no longer holds these blocks."""
        self._append(tier, False, block_hashes)

    def record_load(self, tier: Tier, blocks: int, seconds: float) -> None:
        """A measured load-back of `blocks` blocks from `tier` that took `seconds`."""
        _check_tier(tier)
        if blocks <= 0 or seconds < 0:
            raise ValueError(f"record_load: needs blocks > 0 and seconds >= 0, got {blocks} blocks, {seconds} s")
        with self._lock:
            self._loads.setdefault(tier, deque(maxlen=_LOAD_SAMPLES)).append((blocks, seconds))

    def load_s_per_block(self) -> dict[Tier, float]:
        """Per tier with a measured load-back, the recent mean seconds to load one block (a tier
        never loaded from is absent: its cost is unknown, not zero)."""
        with self._lock:
            return {tier: sum(s for _, s in loads) / sum(b for b, _ in loads) for tier, loads in self._loads.items()}

    def held(self, tier: Tier) -> frozenset[bytes]:
        """The blocks `tier` holds now."""
        _check_tier(tier)
        with self._lock:
            return frozenset(self._held[tier])

    def read(self, cursor: int | None) -> EventBatch:
        """The events a stream at `cursor` (None: a stream starting) has not seen, or a snapshot where
        the log no longer holds them all."""
        with self._lock:
            oldest = self._log[0].seq if self._log else self._next_seq
            if cursor is not None and oldest <= cursor <= self._next_seq:
                # Numbers are consecutive: the newest `next_seq - cursor` events, taken from the end
                # (a stream keeping up reads a few of a long log).
                newest = itertools.islice(reversed(self._log), self._next_seq - cursor)
                return EventBatch(tuple(reversed(list(newest))), reset=False, cursor=self._next_seq)
            # Numbered below the log's next event: a stream whose snapshot is this one reads on after it.
            snapshot = tuple(BlockEvent(self._next_seq - 1, tier, True, tuple(hashes))
                             for tier, hashes in self._held.items() if hashes)
            return EventBatch(snapshot, reset=True, cursor=self._next_seq)

    @property
    def next_seq(self) -> int:
        """The number the next event will get: a stream whose cursor is here has seen everything."""
        with self._lock:
            return self._next_seq

    def _append(self, tier: Tier, stored: bool, block_hashes: Sequence[bytes]) -> None:
        _check_tier(tier)
        if not block_hashes:
            return
        with self._lock:
            self._log.append(BlockEvent(self._next_seq, tier, stored, tuple(block_hashes)))
            self._next_seq += 1
            if stored:
                self._held[tier].update(block_hashes)
            else:
                self._held[tier].difference_update(block_hashes)


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier: must be one of {', '.join(TIERS)}, got {tier!r}")
