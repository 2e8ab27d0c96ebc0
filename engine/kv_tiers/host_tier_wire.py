"""The host tier's protocol over a Unix socket: what a worker asks the node's owner process
(services.host_tier) and how each answer is framed. No torch.

Every request is one opcode byte and its fields; integers are little-endian. Records are the checked
block records of engine.kv_tiers.block_record, so the worker, not the owner, decides whether bytes
read back are a block.

    HELLO                         -> tier id (16 bytes) | capacity (uint64)
    HAS  n (uint32) | n hashes    -> n bytes, 1 where held
    PUT  hash | length (uint64) | record
                                  -> n evicted (uint32) | n hashes
    DROP hash                     -> 1 byte, 1 if it was held (a worker found the record damaged)
    LOAD header size (uint32) | layer size (uint64) | layers (uint32) | n (uint32) | n hashes
                                  -> n lengths (uint64; MISSING when not held)
                                   | the header of each record of the layout's size, in order
                                   | then layer by layer: that layer's slice of each of them, in order

A load is one request answered by a stream that the worker reads layer by layer as its forward needs
the layers, not a request per layer: one round trip per load instead of one per layer (each a wake-up
of the owner's thread on cores the forward is using), and the owner writes the next layers into the
socket's buffer while the worker checks and copies the current one (the buffer is the read-ahead, its
back-pressure the bound). It also makes a record's consistency the owner's alone: it takes the
records when the LOAD arrives and streams those bytes, which never change, so a record evicted or
dropped mid-load is freed after the stream ends and a load never mixes two records' bytes; nothing
is pinned across requests, which a worker that died mid-load would leak. The price: a connection
carries one load at a time, and a worker that abandons a load mid-stream (a layer failed its check,
the engine gave up) closes the connection instead of reading the rest.

Opcode 3 was GET (a whole record, before loads read layer by layer): an older worker sending it is
answered as any unknown opcode, by closing the connection, which that worker counts as a miss.
"""

from __future__ import annotations

import socket
import struct

from engine.kv_cache.block_hash import HASH_SIZE

HELLO, HAS, PUT, DROP, LOAD = 0, 1, 2, 4, 5
TIER_ID_SIZE = 16
MISSING = 2**64 - 1
MAX_RECORD = 1 << 32  # a block record larger than this is a protocol error, not a block

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; ConnectionError if it closes first (a peer that died mid-message:
    what it sent so far is dropped)."""
    received = 0
    while received < len(view):
        count = sock.recv_into(view[received:], len(view) - received)
        if count == 0:
            raise ConnectionError(f"host tier: connection closed {len(view) - received} bytes before the end of a "
                                  "message")
        received += count


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes from `sock` (see `recv_into`)."""
    buffer = bytearray(size)
    recv_into(sock, memoryview(buffer))
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
