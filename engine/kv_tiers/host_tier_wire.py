"""The host tier's protocol over a Unix socket: what a worker asks the node's owner process
(services.host_tier) and how each answer is framed. No torch.

Every request is one opcode byte and its fields; integers are little-endian. Records are the checked
block records of engine.kv_tiers.block_record, so the worker, not the owner, decides whether bytes
read back are a block.

    HELLO                         -> tier id (16 bytes) | capacity (uint64)
    HAS  n (uint32) | n hashes    -> n bytes, 1 where held
    PUT  hash | length (uint64) | record
                                  -> n evicted (uint32) | n hashes
    GET  hash                     -> length (uint64; MISSING when not held) | record
    DROP hash                     -> 1 byte, 1 if it was held (a worker found the record damaged)
"""

from __future__ import annotations

import socket
import struct

from engine.kv_cache.block_hash import HASH_SIZE

HELLO, HAS, PUT, GET, DROP = range(5)
TIER_ID_SIZE = 16
MISSING = 2**64 - 1
MAX_RECORD = 1 << 32  # a block record larger than this is a protocol error, not a block

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes from `sock`; ConnectionError if it closes first (a peer that died
    mid-message: what it sent so far is dropped)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if count == 0:
            raise ConnectionError(f"host tier: connection closed {size - received} bytes before the end of a message")
        received += count
    return bytes(buffer)


def recv_u32(sock: socket.socket) -> int:
    """One uint32."""
    return U32.unpack(recv_exact(sock, U32.size))[0]


def recv_u64(sock: socket.socket) -> int:
    """One uint64."""
    return U64.unpack(recv_exact(sock, U64.size))[0]


def recv_hashes(sock: socket.socket, count: int) -> list[bytes]:
    """`count` block hashes."""
    data = recv_exact(sock, count * HASH_SIZE)
    return [data[i:i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)]
