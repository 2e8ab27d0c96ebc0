"""The host tier's owner: one process per node holding KV block records in its memory, bounded,
evicted least recently used first, for every worker of the node (engine.kv_tiers.host_tier_wire).

Why one owner process and a Unix socket, not a shared-memory arena the workers map: the owner alone
decides what is stored, so a worker killed mid-write cannot leave a half-written block visible (a
record is stored only once all its bytes arrived, and it carries its own check); the workers need
only a socket path, which in Kubernetes is a hostPath directory, where a shared arena would need
the pods to share the node's IPC namespace; and a worker restart or an owner restart is just a
reconnect. The price is one copy through the kernel each way, which docs/benchmarks.md measures
against the time it saves.

A load is answered as a stream, layer by layer (engine.kv_tiers.host_tier_wire says why), from the
records as they were when it arrived: a record's bytes never change, so one evicted or dropped while
it streams stays whole in memory until its stream ends.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from engine.kv_cache.block_hash import HASH_SIZE
from engine.kv_tiers.host_tier_wire import (
    DROP,
    HAS,
    HELLO,
    LOAD,
    MAX_RECORD,
    MISSING,
    PUT,
    U32,
    U64,
    recv_exact,
    recv_hashes,
    recv_u32,
    recv_u64,
)

log = logging.getLogger(__name__)


class HostTierStore:
    """The records by chain hash, at most `capacity_bytes` of them; thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_mib: must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.tier_id = uuid.uuid4().bytes  # a restarted owner is a new tier: what workers knew of it is gone
        self._records: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def has(self, hashes: list[bytes]) -> bytes:
        """One byte per hash: 1 where held."""
        with self._lock:
            return bytes(int(h in self._records) for h in hashes)

    def put(self, block_hash: bytes, record: bytes) -> list[bytes]:
        """Store a record (refused if larger than the whole tier); the hashes evicted for it."""
        with self._lock:
            if block_hash in self._records:
                self._records.move_to_end(block_hash)
                return []
            if len(record) > self.capacity_bytes:
                return []
            self._records[block_hash] = record
            self._bytes += len(record)
            evicted = []
            while self._bytes > self.capacity_bytes:
                old, dropped = self._records.popitem(last=False)
                self._bytes -= len(dropped)
                evicted.append(old)
            return evicted

    def drop(self, block_hash: bytes) -> bool:
        """Forget a record (a worker found it damaged); whether it was held."""
        with self._lock:
            record = self._records.pop(block_hash, None)
            if record is not None:
                self._bytes -= len(record)
            return record is not None

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        """The record stored under each of `hashes`, or None where none is."""
        with self._lock:
            records = [self._records.get(block_hash) for block_hash in hashes]
            for block_hash, record in zip(hashes, records, strict=True):
                if record is not None:
                    self._records.move_to_end(block_hash)
            return records


class _Connection(socketserver.BaseRequestHandler):
    """One worker's connection: requests answered in order until it closes."""

    server: HostTierServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        store = self.server.store
        try:
            while True:
                opcode = sock.recv(1)
                if not opcode:
                    return
                if opcode[0] == LOAD:
                    _stream_load(sock, store)
                else:
                    sock.sendall(self._answer(opcode[0], sock, store))
        except (ConnectionError, ValueError) as error:
            log.info("host tier: a worker's connection ended: %s", error)

    @staticmethod
    def _answer(opcode: int, sock: socket.socket, store: HostTierStore) -> bytes:
        if opcode == HELLO:
            return store.tier_id + U64.pack(store.capacity_bytes)
        if opcode == HAS:
            return store.has(recv_hashes(sock, recv_u32(sock)))
        if opcode == PUT:
            block_hash = recv_exact(sock, HASH_SIZE)
            length = recv_u64(sock)
            if length > MAX_RECORD:
                raise ValueError(f"a record of {length} bytes")
            evicted = store.put(block_hash, recv_exact(sock, length))
            return U32.pack(len(evicted)) + b"".join(evicted)
        if opcode == DROP:
            return bytes([store.drop(recv_exact(sock, HASH_SIZE))])
        raise ValueError(f"unknown opcode {opcode}")


def _stream_load(sock: socket.socket, store: HostTierStore) -> None:
    """Answer a LOAD: each record's length, the headers of those of the asked layout's size, then
    layer by layer their slices, as fast as the worker reads them."""
    header_size, layer_size, layers, count = recv_u32(sock), recv_u64(sock), recv_u32(sock), recv_u32(sock)
    record_size = header_size + layers * layer_size
    if record_size > MAX_RECORD:
        raise ValueError(f"a load of records of {record_size} bytes")
    records = store.get_many(recv_hashes(sock, count))
    streamed = [memoryview(r) for r in records if r is not None and len(r) == record_size]
    sock.sendall(b"".join(U64.pack(MISSING if r is None else len(r)) for r in records)
                 + b"".join(r[:header_size] for r in streamed))
    for layer in range(layers):
        start = header_size + layer * layer_size
        for record in streamed:
            sock.sendall(record[start:start + layer_size])


class HostTierServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The owner's server on a Unix socket path, one thread per worker connection."""

    daemon_threads = True

    def __init__(self, path: str | Path, capacity_bytes: int) -> None:
        self.store = HostTierStore(capacity_bytes)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A socket left by an owner that died is replaced; a live owner's is not.
        if path.exists():
            if _answers(path):
                raise ValueError(f"socket: {str(path)!r} already has a live host tier owner")
            path.unlink()
        super().__init__(str(path), _Connection)
        os.chmod(path, 0o660)


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True
