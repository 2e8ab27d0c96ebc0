"""Which worker likely holds which KV block, as far as the gateway's own placements tell it: the
estimated prefix index, for workers whose block events cannot be trusted or reached (llm-d's
scheduler offers the same pair: a precise scorer from KV events and an estimated one).

Every prompt placed on a worker is recorded there (by the chain hashes the exact index uses,
services.gateway.block_index), in its device tier, since that is where a prompt's blocks land. The
worker's own evictions are not seen, so each worker's record is an LRU bounded by a guessed
capacity, its KV cache's size in blocks: the most it can hold. The guess is too generous when
running requests' blocks crowd out cached ones, and knows nothing of lower tiers or of blocks the
worker cached from its replies. Imports neither grpc nor torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from engine.kv_cache.kv_events import Tier
from services.gateway.block_index import PrefixHit

# Which index the gateway routes by: "exact" (services.gateway.block_index, from the workers' block
# events) or "approximate" (this one, from its own placements).
PrefixIndexKind = Literal["exact", "approximate"]


class ApproximateIndex:
    """Per worker (by address), the block hashes of the prompts placed there, least recent first."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, address: str, hashes: Sequence[bytes], capacity_blocks: int) -> None:
        """A prompt with these blocks was placed on the worker: they are its most recent; it keeps
        at most `capacity_blocks` (the least recently placed go first)."""
        held = self._held.setdefault(address, OrderedDict())
        for block_hash in hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > max(0, capacity_blocks):
            held.popitem(last=False)

    def prefix(self, address: str, hashes: Sequence[bytes]) -> PrefixHit:
        """The prompt's leading blocks (`hashes`) the worker likely holds on its device."""
        held = self._held.get(address, {})
        blocks = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            blocks += 1
        return PrefixHit({"device": blocks} if blocks else {})

    def forget(self, address: str) -> None:
        """The worker is gone or restarted (with an empty cache)."""
        self._held.pop(address, None)

    def counts(self, address: str) -> dict[Tier, int]:
        """How many blocks the worker likely holds, by tier (the device only)."""
        held = self._held.get(address)
        return {"device": len(held)} if held is not None else {}

    @property
    def size(self) -> int:
        """Block entries held, over every worker."""
        return sum(len(held) for held in self._held.values())
