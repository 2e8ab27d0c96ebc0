"""One load's blocks read back from the lower tiers layer by layer (engine.kv_tiers.tiers opens it,
the mover, engine.kv_connector.tier_mover, reads it). No torch.

Each block comes from the tier that had a record of it: the host tier's answer stream
(engine.kv_tiers.host_tier_client.RecordStream) or its file on disk
(engine.kv_tiers.disk_tier.DiskRecord), its header already read and checked. `layer(i)` reads only
layer i's slice of every block, straight into one array, and checks each slice against the CRC its
header holds; so layer i can be written while the later layers' bytes are still unread, and layer 0
waits for the headers and one layer's bytes, not for whole records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from engine.kv_tiers.block_record import RecordHeader, RecordLayout
from engine.kv_tiers.disk_tier import DiskRecord
from engine.kv_tiers.host_tier_client import RecordStream

LowerTier = Literal["host", "disk"]


@dataclass(frozen=True)
class Damaged:
    """The block whose layer `layer` came up short or failed its check: it ended its load."""

    tier: LowerTier
    block_hash: bytes
    layer: int


@dataclass(frozen=True)
class _Block:
    block_hash: bytes
    tier: LowerTier
    header: RecordHeader
    disk: DiskRecord | None  # None: it comes on the host tier's stream


class TierLoad:
    """The blocks of one load, in order, each added from the tier that serves it (`add`)."""

    def __init__(self, layout: RecordLayout, stream: RecordStream | None) -> None:
        self._layout = layout
        self._stream = stream
        self._blocks: list[_Block] = []
        self.damaged: Damaged | None = None

    def add(self, block_hash: bytes, tier: LowerTier, header: RecordHeader, disk: DiskRecord | None = None) -> None:
        """The next block: from the host tier's stream, or from `disk`."""
        self._blocks.append(_Block(block_hash, tier, header, disk))

    @property
    def tiers(self) -> list[LowerTier]:
        """The tier of each block."""
        return [block.tier for block in self._blocks]

    def layer(self, index: int) -> np.ndarray | None:
        """Layer `index` of every block, read now and checked ([blocks, layer bytes] uint8; layers are
        read in order, each once); None if a block's bytes did not come or failed their check, which
        ends the load (`damaged` names that block; it stays None when the host tier's connection was
        lost, which its client counts)."""
        pages = np.empty((len(self._blocks), self._layout.layer_size), dtype=np.uint8)
        unused = None
        for position, (block, row) in enumerate(zip(self._blocks, pages, strict=True)):
            view = memoryview(row)
            # The stream carries every record the host tier had of this layout, in order, even one
            # whose header failed (its block then comes from disk): that one's bytes are read past.
            if self._stream is not None and self._stream.headers[position] is not None:
                if block.disk is not None:
                    unused = unused if unused is not None else memoryview(bytearray(self._layout.layer_size))
                if not self._stream.read_into(view if block.disk is None else unused):
                    return None
            if (block.disk is not None and not block.disk.read_into(view)) or not block.header.check(index, row):
                self.damaged = Damaged(block.tier, block.block_hash, index)
                return None
        return pages

    def close(self) -> None:
        """Close the stream (abandoned if not read to its end) and the files."""
        if self._stream is not None:
            self._stream.close()
        for block in self._blocks:
            if block.disk is not None:
                block.disk.close()
