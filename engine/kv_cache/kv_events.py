"""Placeholder of the engine's block events (helper C's branch replaces this file)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal

Tier = Literal["device", "host", "disk"]


class KVEvents:
    """What each tier holds, as its stores and removals report it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held: dict[str, set[bytes]] = {"device": set(), "host": set(), "disk": set()}
        self._loads: dict[str, tuple[int, float]] = {}

    def stored(self, tier: Tier, block_hashes: Sequence[bytes]) -> None:
        with self._lock:
            self.held[tier].update(block_hashes)

    def removed(self, tier: Tier, block_hashes: Sequence[bytes]) -> None:
        with self._lock:
            self.held[tier].difference_update(block_hashes)

    def record_load(self, tier: Tier, blocks: int, seconds: float) -> None:
        with self._lock:
            total_blocks, total_seconds = self._loads.get(tier, (0, 0.0))
            self._loads[tier] = (total_blocks + blocks, total_seconds + seconds)

    def load_s_per_block(self) -> dict[Tier, float]:
        with self._lock:
            return {tier: seconds / blocks for tier, (blocks, seconds) in self._loads.items() if blocks}  # type: ignore[misc]
