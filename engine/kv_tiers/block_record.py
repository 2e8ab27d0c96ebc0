"""One KV block as a lower tier stores it: a header naming the block and checking its bytes, then the
pages. No torch.

A tier returns exactly what was stored under a hash or nothing; a record that does not check (a
truncated file, a flipped bit, a file renamed to another block's name, a record of another layout)
is a miss, never pages. The chain hash in the header guards against a record filed under the wrong
name; the blake2b digest against damaged bytes; the length against truncation.

    magic "TKV1" | chain hash (32 bytes) | payload length (uint64 LE) | blake2b-16 of the payload | payload
"""

from __future__ import annotations

import hashlib
import struct

from engine.kv_cache.block_hash import HASH_SIZE

MAGIC = b"TKV1"
_DIGEST_SIZE = 16
_HEADER = struct.Struct(f"<4s{HASH_SIZE}sQ{_DIGEST_SIZE}s")
HEADER_SIZE = _HEADER.size


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=_DIGEST_SIZE).digest()


def pack_record(block_hash: bytes, payload: bytes) -> bytes:
    """The record of one block's pages (`payload`) under its chain hash."""
    if len(block_hash) != HASH_SIZE:
        raise ValueError(f"block_hash: must be {HASH_SIZE} bytes, got {len(block_hash)}")
    return _HEADER.pack(MAGIC, block_hash, len(payload), _digest(payload)) + payload


def unpack_record(block_hash: bytes, record: bytes, payload_size: int) -> memoryview | None:
    """The pages of a record read back for `block_hash`, or None if it is not a whole, intact record
    of that block with `payload_size` bytes of pages."""
    if len(record) != HEADER_SIZE + payload_size:
        return None
    magic, stored_hash, length, digest = _HEADER.unpack_from(record)
    payload = memoryview(record)[HEADER_SIZE:]
    if magic != MAGIC or stored_hash != block_hash or length != payload_size or _digest(payload) != digest:
        return None
    return payload
