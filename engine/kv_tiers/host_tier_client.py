"""A worker's connection to its node's host tier owner (services.host_tier.owner). No torch.

The owner may be absent, restarted or slow to start: every operation that cannot reach it is a miss
(or a write not made) and a count, never an error for a request. A connection lost mid-operation is
remade at once (the owner may have restarted); one that cannot be made is retried at most once a
second. A restarted owner has a new tier id and none of the old blocks; `tier_id` says
which owner answered last, so the caller can forget what it knew of the previous one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.kv_tiers.host_tier_wire import (
    DROP,
    GET,
    HAS,
    HELLO,
    MISSING,
    PUT,
    TIER_ID_SIZE,
    U32,
    U64,
    recv_exact,
    recv_hashes,
    recv_u32,
    recv_u64,
)

RETRY_S = 1.0
T = TypeVar("T")


class HostTierClient:
    """One connection (thread-safe: one request at a time) to the owner at `path`."""

    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.path = path
        self.tier_id = b""  # the owner that answered last ("" before any)
        self.errors = 0  # operations that could not reach the owner
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def hello(self) -> bytes:
        """Connect if not connected; the owner's tier id (b"" when unreachable)."""
        with self._lock:
            self._connected()
        return self.tier_id

    def has(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which of `hashes` the owner holds (none when unreachable)."""
        if not hashes:
            return []
        answer = self._call(bytes([HAS]) + U32.pack(len(hashes)) + b"".join(hashes),
                            lambda sock: recv_exact(sock, len(hashes)))
        return [False] * len(hashes) if answer is None else [bool(b) for b in answer]

    def put(self, block_hash: bytes, record: bytes) -> list[bytes] | None:
        """Store a record; the hashes the owner evicted for it, or None if it was not stored."""
        return self._call(bytes([PUT]) + block_hash + U64.pack(len(record)) + record,
                          lambda sock: recv_hashes(sock, recv_u32(sock)))

    def get(self, block_hash: bytes) -> bytes | None:
        """The record stored under `block_hash`, or None (not held, or unreachable)."""
        def read(sock: socket.socket) -> bytes | None:
            length = recv_u64(sock)
            return None if length == MISSING else recv_exact(sock, length)

        return self._call(bytes([GET]) + block_hash, read)

    def drop(self, block_hash: bytes) -> None:
        """Have the owner forget a record (found damaged), so no worker loads it again."""
        self._call(bytes([DROP]) + block_hash, lambda sock: recv_exact(sock, 1))

    def _call(self, message: bytes, read: Callable[[socket.socket], T]) -> T | None:
        with self._lock:
            # A connection that was up may have lost a restarted owner: one fresh try at once.
            for _ in range(2 if self._sock is not None else 1):
                sock = self._connected()
                if sock is None:
                    break
                try:
                    sock.sendall(message)
                    return read(sock)
                except OSError:
                    self._drop()
            self.errors += 1
            return None

    def _connected(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        if time.monotonic() < self._retry_at:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout_s)
        try:
            sock.connect(self.path)
            sock.sendall(bytes([HELLO]))
            self.tier_id = recv_exact(sock, TIER_ID_SIZE)
            recv_u64(sock)  # its capacity: the owner bounds itself
        except OSError:
            sock.close()
            self._retry_at = time.monotonic() + RETRY_S
            return None
        self._sock = sock
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._drop()
