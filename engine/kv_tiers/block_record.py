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

The payload is layer-major (each layer's K page then V page), so layer i is the i-th equal slice. A
load reads the header first (`open_header`), then one layer's slice of each block at a time, checking
each slice against its CRC as it arrives (`RecordHeader.check`): layer 0 is usable after the header
and one layer's bytes, not the whole record's.
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


class RecordHeader:
    """A record's header that names the expected block and layout: the CRC of each of its layers."""

    def __init__(self, header: bytes, layout: RecordLayout) -> None:
        self._crcs = [_CRC.unpack_from(header, _HEADER.size + i * _CRC.size)[0] for i in range(layout.layers)]

    def check(self, index: int, pages: np.ndarray) -> bool:
        """Whether `pages` (uint8) are layer `index`'s bytes as stored."""
        return _crc32c(pages) == self._crcs[index]


def open_header(block_hash: bytes, header: bytes, layout: RecordLayout) -> RecordHeader | None:
    """The header read back for `block_hash` (the first `layout.header_size` bytes of its record), or
    None if it is not a header of that block in `layout` (its layers are checked as they are read)."""
    if len(header) != layout.header_size:
        return None
    magic, stored_hash, length, layers = _HEADER.unpack_from(header)
    if magic != MAGIC or stored_hash != block_hash or length != layout.payload_size or layers != layout.layers:
        return None
    return RecordHeader(header, layout)
