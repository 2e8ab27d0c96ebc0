"""One KV block as a lower tier stores it: a header naming the block and checking its bytes layer by
layer, then the pages. No torch.

A tier returns exactly what was stored under a hash or nothing; a record that does not check (a
truncated file, a flipped bit, a file renamed to another block's name, a record of another layout or
of the older TKV1 format) is a miss, never pages. The chain hash in the header guards against a
record filed under the wrong name; the lengths against truncation and other layouts; a CRC32C per
layer against damaged bytes. The checksum guards against accidents, not adversaries (whoever can
write a tier can write any header), so a CRC (hardware-assisted, ~20x cheaper than blake2b here)
suffices; one per layer lets a load check and write a layer without waiting for the whole block.

    magic "TKV2" | chain hash (32 bytes) | payload length (uint64 LE) | layers (uint32 LE)
    | CRC32C of each layer's bytes (uint32 LE each) | payload

The payload is layer-major (each layer's K page then V page), so layer i is the i-th equal slice.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import google_crc32c
import numpy as np

from engine.kv_cache.block_hash import HASH_SIZE

MAGIC = b"TKV2"
_HEADER = struct.Struct(f"<4s{HASH_SIZE}sQI")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class RecordLayout:
    """The shape of one worker's blocks: `payload_size` bytes of pages over `layers` layers."""

    payload_size: int
    layers: int

    def __post_init__(self) -> None:
        if self.layers <= 0 or self.payload_size % self.layers:
            raise ValueError(f"a block of {self.payload_size} bytes does not split into {self.layers} layers")

    @property
    def layer_size(self) -> int:
        """Bytes of one layer's pages in a block."""
        return self.payload_size // self.layers

    @property
    def header_size(self) -> int:
        """Bytes before the payload."""
        return _HEADER.size + self.layers * _CRC.size

    @property
    def record_size(self) -> int:
        """Bytes of a whole record."""
        return self.header_size + self.payload_size


def pack_record(block_hash: bytes, payload: bytes, layout: RecordLayout) -> bytes:
    """The record of one block's pages (`payload`) under its chain hash."""
    if len(block_hash) != HASH_SIZE:
        raise ValueError(f"block_hash: must be {HASH_SIZE} bytes, got {len(block_hash)}")
    if len(payload) != layout.payload_size:
        raise ValueError(f"payload: must be {layout.payload_size} bytes, got {len(payload)}")
    data, size = np.frombuffer(payload, dtype=np.uint8), layout.layer_size
    crcs = b"".join(_CRC.pack(_crc32c(data[i * size:(i + 1) * size])) for i in range(layout.layers))
    return _HEADER.pack(MAGIC, block_hash, len(payload), layout.layers) + crcs + payload


def _crc32c(data: np.ndarray) -> int:
    # google_crc32c takes numpy arrays without a copy, but refuses memoryview slices.
    return google_crc32c.value(data)


class CheckedRecord:
    """A record whose header names the expected block and layout; its layers are checked as read."""

    def __init__(self, record: bytes | memoryview, layout: RecordLayout) -> None:
        self._data = np.frombuffer(record, dtype=np.uint8)
        self._layout = layout
        self._crcs = [_CRC.unpack_from(record, _HEADER.size + i * _CRC.size)[0] for i in range(layout.layers)]

    def layer(self, index: int) -> np.ndarray | None:
        """Layer `index`'s pages (K then V, uint8, read-only), or None if they do not match their checksum."""
        size = self._layout.layer_size
        start = self._layout.header_size + index * size
        if _crc32c(self._data[start:start + size]) != self._crcs[index]:
            return None
        return self._data[start:start + size]


def open_record(block_hash: bytes, record: bytes, layout: RecordLayout) -> CheckedRecord | None:
    """A record read back for `block_hash`, its header checked (its layers not yet), or None if it is
    not a whole record of that block in `layout`."""
    if len(record) != layout.record_size:
        return None
    magic, stored_hash, length, layers = _HEADER.unpack_from(record)
    if magic != MAGIC or stored_hash != block_hash or length != layout.payload_size or layers != layout.layers:
        return None
    return CheckedRecord(record, layout)
