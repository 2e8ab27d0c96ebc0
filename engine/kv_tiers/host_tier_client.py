"""A worker's connection to its node's host tier owner (services.host_tier.owner). No torch.

The owner may be absent, restarted or slow to start: every operation that cannot reach it is a miss
(or a write not made) and a count, never an error for a request. A connection lost mid-operation is
remade at once (the owner may have restarted); one that cannot be made is retried at most once a
second. A restarted owner has a new tier id and none of the old blocks; `tier_id` says
which owner answered last, so the caller can forget what it knew of the previous one.

A load's answer is a stream read layer by layer while the engine computes (`load`, `RecordStream`):
the stream takes the connection for itself, so the client's other calls meanwhile (from any thread)
open another rather than interleave with it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.kv_tiers.block_record import RecordLayout
from engine.kv_tiers.host_tier_wire import (
    DROP,
    HAS,
    HELLO,
    LOAD,
    MISSING,
    PUT,
    TIER_ID_SIZE,
    U32,
    U64,
    recv_exact,
    recv_hashes,
    recv_into,
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

    def load(self, hashes: Sequence[bytes], layout: RecordLayout) -> RecordStream | None:
        """Ask for the records of `hashes` (in `layout`) layer by layer: which the owner holds and their
        headers now, their layers as the stream is read; None when unreachable."""
        message = (bytes([LOAD]) + U32.pack(layout.header_size) + U64.pack(layout.layer_size)
                   + U32.pack(layout.layers) + U32.pack(len(hashes)) + b"".join(hashes))

        def begin(sock: socket.socket) -> tuple[list[int], list[bytes | None]]:
            data = recv_exact(sock, len(hashes) * U64.size)
            lengths = [U64.unpack_from(data, i * U64.size)[0] for i in range(len(hashes))]
            return lengths, [recv_exact(sock, layout.header_size) if n == layout.record_size else None
                             for n in lengths]

        with self._lock:
            answer = self._request(message, begin)
            if answer is None:
                return None
            sock, self._sock = self._sock, None  # the stream's alone until it ends
        lengths, headers = answer
        return RecordStream(self, sock, lengths, headers, layout)

    def drop(self, block_hash: bytes) -> None:
        """Have the owner forget a record (found damaged), so no worker loads it again."""
        self._call(bytes([DROP]) + block_hash, lambda sock: recv_exact(sock, 1))

    def _call(self, message: bytes, read: Callable[[socket.socket], T]) -> T | None:
        with self._lock:
            return self._request(message, read)

    def _request(self, message: bytes, read: Callable[[socket.socket], T]) -> T | None:
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

    def _stream_ended(self, sock: socket.socket, whole: bool, lost: bool = False) -> None:
        """A load's stream gives its connection back: kept if it was read to the end (and no other was
        opened meanwhile), else closed (the rest of its answer would come first); `lost` if it broke."""
        with self._lock:
            self.errors += lost
            if whole and self._sock is None:
                self._sock = sock
            else:
                sock.close()

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._drop()


class RecordStream:
    """The answer to one LOAD as it is read: which records the owner holds (`held`), the header of each
    it streams (`headers`, None for the others), then layer by layer each streamed record's slice, in
    order (`read_into`). Close it when done (`close`)."""

    def __init__(self, client: HostTierClient, sock: socket.socket, lengths: list[int],
                 headers: list[bytes | None], layout: RecordLayout) -> None:
        self.held = [length != MISSING for length in lengths]
        self.headers = headers
        self.bytes_read = len(lengths) * U64.size + sum(len(h) for h in headers if h is not None)
        self._client = client
        self._sock: socket.socket | None = sock
        self._remaining = layout.payload_size * sum(h is not None for h in headers)

    def read_into(self, view: memoryview) -> bool:
        """Fill `view` with the stream's next bytes; False if the connection was lost (a miss)."""
        if self._sock is None:
            return False
        try:
            recv_into(self._sock, view)
        except OSError:
            self._client._stream_ended(self._sock, whole=False, lost=True)
            self._sock = None
            return False
        self._remaining -= len(view)
        self.bytes_read += len(view)
        return True

    def close(self) -> None:
        """End the stream: its connection goes back to the client if it was read to the end."""
        if self._sock is not None:
            self._client._stream_ended(self._sock, self._remaining == 0)
            self._sock = None
