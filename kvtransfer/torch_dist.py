"""Pairwise torch.distributed groups between one prefill and one decode process, and their wire.

`init_process_group` can run only once per process, so each (prefill, decode) pair gets its own
two-rank group built directly on a store: rank 0 is the receiver (decode), rank 1 the sender
(prefill). The receiver hosts a TCPStore on an ephemeral port of its configured host only (the
store's own listener binds every interface, so it is handed an already bound socket); the store
lives only until both ranks said hello, then it is closed, which torch allows once nothing holds
it: the group keeps a reference to its store, so it gets a wrapper whose link to the real store is
cut after pairing. Gloo also listens for its pair connection, on the same host.

Messages are raw tensors: a fixed int64 header, then for pages the K and V bytes of each page run
it lists, as uint8 (so every dtype, bfloat16 included, travels the same way; gloo's send/recv does
handle bfloat16 too). A PAGES header carries a checksum of all the bytes that follow it, which the
receiver checks before writing any of them (`payload_checksum`): CRC32C on gloo, whose pages are on
the CPU; on NCCL, whose pages stay on the GPU, the device sums of kvtransfer.device_checksum, since
a CRC32C would copy every page to the host. Pairing is also the checksum handshake: each side puts
its `--kv-checksum` in the store, and a pair checksums unless both are off
(kvtransfer.descriptor.checksum_agreed); its receiver then refuses pages that come without one.

Gloo facts this relies on (measured with torch 2.13):
- a send leaves only once the peer posted the matching receive, so receivers post ahead;
- a receive whose wait times out closes the pair, so idle waits between transfers never time out;
- a peer's death fails pending operations at once;
- `abort()` and `shutdown()` do not wake a thread blocked in a receive, hence the BYE message;
- `Work.is_completed()` stays False until `wait()` is called, so receives cannot be polled;
- a process that exits while a thread is blocked in a gloo wait aborts (std::terminate), so both
  sides' `close()` ends their pairs and joins the threads.

NCCL (dist_backend "nccl", tensors on the current CUDA device) goes through the same code; its pairs
have not run end to end here: no machine here has two GPUs, and NCCL refuses two ranks on one GPU
(the device sums were checked on a GPU: tests/unit/test_device_checksum.py).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import IntEnum

import google_crc32c
import torch
import torch.distributed as dist

from kvtransfer.descriptor import checksum_agreed
from kvtransfer.device_checksum import device_checksum, device_checksum_tensor

MAGIC = 0x4B56_5041_4745_5332  # "KVPAGES2"
# Between transfers a pair may sit idle for any time; its header recv must not expire.
IDLE_TIMEOUT = timedelta(days=365)
RECEIVER_RANK, SENDER_RANK = 0, 1
_JOINED = "joined"  # set by the sender in the pairing store before it builds its side of the group
# Each side's --kv-checksum ("on" or "off"), in the pairing store: the receiver's is there before
# its target leaves, the sender's before it joins.
_RECEIVER_CHECKSUM, _SENDER_CHECKSUM = "receiver_checksum", "sender_checksum"
_JOIN_POLL_S = 0.02


class Kind(IntEnum):
    """What a message is."""

    HELLO = 1  # the sender's group is up: the rendezvous store can close
    PAGES = 2  # the K and V of each listed page run follow, in list order
    END = 3  # the transfer's last pages were sent
    ABORT = 4  # the sender gave the transfer up
    BYE = 5  # closing the pair; answered with BYE, after which the receiving thread ends


# Page runs one PAGES message may carry. Layers queued together (the prefill ran ahead of the wire)
# go as one message, so the receiver posts all their receives at once: a round trip per message,
# not per layer, is what a gloo send costs beyond the copy.
MAX_RUNS = 32


@dataclass(frozen=True)
class PageRun:
    """One layer's K and V for consecutive blocks of a transfer's target."""

    layer: int
    first_block: int
    num_blocks: int
    nbytes: int  # of each of K and V


@dataclass(frozen=True)
class Header:
    """The fixed-size int64 header sent before every message."""

    kind: Kind
    transfer_id: int = 0
    runs: tuple[PageRun, ...] = ()
    checksum: int | None = None  # of the bytes that follow (see payload_checksum); None: unchecked

    SIZE = 5 + 4 * MAX_RUNS
    CHECKSUM_INDEX = 4  # of the checksum in the int64 values sent

    def __post_init__(self) -> None:
        if len(self.runs) > MAX_RUNS:
            raise ValueError(f"a message carries at most {MAX_RUNS} page runs, got {len(self.runs)}")

    @property
    def nbytes(self) -> int:
        """The K and V bytes that follow the header."""
        return 2 * sum(run.nbytes for run in self.runs)

    def tensor(self) -> torch.Tensor:
        """The header as sent."""
        checksum = _NO_CHECKSUM if self.checksum is None else self.checksum
        values = [MAGIC, self.kind, self.transfer_id, len(self.runs), checksum]
        for run in self.runs:
            values += [run.layer, run.first_block, run.num_blocks, run.nbytes]
        return torch.tensor(values + [0] * (self.SIZE - len(values)), dtype=torch.int64)

    @classmethod
    def parse(cls, tensor: torch.Tensor) -> Header:
        """Read a received header; ValueError if it is not one."""
        values = tensor.cpu().tolist()
        magic, kind, transfer_id, count, checksum = values[:5]
        if magic != MAGIC or kind not in Kind._value2member_map_ or not 0 <= count <= MAX_RUNS:
            raise ValueError(f"not a KV message header: {values[:4]}")
        runs = tuple(PageRun(*values[5 + 4 * i: 9 + 4 * i]) for i in range(count))
        return cls(Kind(kind), transfer_id, runs, None if checksum == _NO_CHECKSUM else checksum)


_NO_CHECKSUM = -1  # a CRC32C is never negative


def payload_checksum(tensors: list[torch.Tensor]) -> int:
    """The checksum of the bytes of flat uint8 tensors, one after the other, all on one device:
    CRC32C on the CPU; on a GPU the device sums (kvtransfer.device_checksum), so that no page is
    copied to the host to be checked. Never negative (a header's "none" is -1)."""
    if tensors and tensors[0].device.type != "cpu":
        return device_checksum(tensors)
    checksum = 0
    for tensor in tensors:
        checksum = google_crc32c.extend(checksum, tensor.numpy())
    return checksum


def pages_header(header: Header, payload: list[torch.Tensor], device: torch.device, checksum: bool) -> torch.Tensor:
    """The header tensor of a message on `device`; a PAGES one carries the payload's checksum when
    the pair agreed on one. On a GPU the checksum is written into the header there (a sender never
    waits for the device: the send is enqueued behind the reduction)."""
    if header.kind is not Kind.PAGES or not checksum:
        return header.tensor().to(device)
    if device.type == "cpu":
        return replace(header, checksum=payload_checksum(payload)).tensor()
    tensor = header.tensor().to(device)
    tensor[Header.CHECKSUM_INDEX] = device_checksum_tensor(payload)
    return tensor


def checksum_name(device: torch.device) -> str:
    """What `payload_checksum` computes for pages on `device`, for error messages."""
    return "CRC32C" if device.type == "cpu" else "device checksum"


class _DetachableStore(dist.Store):
    """A store whose link to the real store can be cut, so the real one closes while the group
    (which keeps its store) lives on. Gloo uses only set, get and wait, all during pairing."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner: dist.Store | None = inner

    def _store(self) -> dist.Store:
        if self._inner is None:
            raise RuntimeError("the pairing store is closed")
        return self._inner

    def set(self, key: str, value: bytes) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        return self._store().get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._store().wait(keys)
        else:
            self._store().wait(keys, timeout)

    def detach(self) -> None:
        self._inner = None


class PairGroup:
    """A two-rank group seen from one side; raises RuntimeError when the pair breaks."""

    def __init__(self, group: dist.ProcessGroup, peer_rank: int, device: torch.device, checksum: bool) -> None:
        """`checksum`: whether PAGES messages carry a checksum (`payload_checksum`), as both sides
        agreed when pairing."""
        self._group = group
        self._peer = peer_rank
        self.device = device
        self.checksum = checksum

    def post_send(self, tensor: torch.Tensor) -> dist.Work:
        """Start sending `tensor`; gloo sends it once the peer posted the matching receive, and
        sends posted one after another meet the peer's receives in order."""
        return self._group.send([tensor], self._peer, 0)

    def post_recv(self, tensor: torch.Tensor) -> dist.Work:
        """Start receiving into `tensor`, whose size must match the sent one's; receives posted
        one after another take the peer's sends in order."""
        return self._group.recv([tensor], self._peer, 0)

    def send_header(self, header: Header, timeout: timedelta) -> None:
        """Send a message header alone; returns once it left."""
        self.post_send(header.tensor().to(self.device)).wait(timeout)

    def recv_header(self, timeout: timedelta) -> Header:
        """Receive the next message header."""
        tensor = self.header_buffer()
        self.post_recv(tensor).wait(timeout)
        return Header.parse(tensor)

    def header_buffer(self) -> torch.Tensor:
        """A tensor to receive a header into."""
        return torch.empty(Header.SIZE, dtype=torch.int64, device=self.device)


class Rendezvous:
    """The receiver's pairing store: one ephemeral port on `host`, open until the group is up.
    `checksum` is the receiver's `--kv-checksum`."""

    def __init__(self, host: str, namespace: str, timeout: float, checksum: bool = True) -> None:
        listener = socket.create_server((host, 0))
        self.host = host
        self.port: int = listener.getsockname()[1]
        self._timeout = timeout
        # The store takes ownership of the bound socket (it closes the descriptor itself).
        server = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout), master_listen_fd=listener.detach())
        self._prefixed: dist.Store | None = dist.PrefixStore(namespace, server)
        self._prefixed.set(_RECEIVER_CHECKSUM, _setting(checksum))
        self._checksum = checksum
        self._store = _DetachableStore(self._prefixed)

    def accept(self, dist_backend: str, stop: threading.Event) -> PairGroup:
        """Wait for the sender to join (up to the timeout, or until `stop` is set), build the
        group and take its hello; closes the store either way."""
        limit = timedelta(seconds=self._timeout)
        try:
            # Polled, not waited on inside gloo, so that closing the receiver interrupts it.
            deadline = time.monotonic() + self._timeout
            while not self._prefixed.check([_JOINED]):
                if stop.wait(_JOIN_POLL_S):
                    raise RuntimeError("the receiver closed before the sender joined")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no sender joined within {self._timeout:g} s")
            checksum = checksum_agreed(self._checksum, self._prefixed.get(_SENDER_CHECKSUM) == _setting(True))
            group = _new_group(self._store, RECEIVER_RANK, dist_backend, self.host, limit, checksum)
            hello = group.recv_header(limit)
            if hello.kind is not Kind.HELLO:
                raise ValueError(f"expected HELLO from the sender, got {hello.kind.name}")
            return group
        finally:
            self._store.detach()
            self._prefixed = None


def join(host: str, port: int, namespace: str, dist_backend: str, timeout: float,
         local_host: str | None = None, checksum: bool = True) -> PairGroup:
    """The sender's side of pairing: join the receiver's store and group, then say hello. Its side
    of the group listens on `local_host` (None: the local address that routes to the receiver);
    `checksum` is the sender's `--kv-checksum`."""
    limit = timedelta(seconds=timeout)
    client = dist.PrefixStore(namespace, dist.TCPStore(host, port, is_master=False, timeout=limit))
    store = _DetachableStore(client)
    try:
        agreed = checksum_agreed(client.get(_RECEIVER_CHECKSUM) == _setting(True), checksum)
        client.set(_SENDER_CHECKSUM, _setting(checksum))
        client.set(_JOINED, b"1")
        local = local_host or _local_address_towards(host, port)
        group = _new_group(store, SENDER_RANK, dist_backend, local, limit, agreed)
        group.send_header(Header(Kind.HELLO), limit)
        return group
    finally:
        store.detach()


def _setting(checksum: bool) -> bytes:
    return b"on" if checksum else b"off"


def _new_group(store: dist.Store, rank: int, dist_backend: str, local_host: str, timeout: timedelta,
               checksum: bool) -> PairGroup:
    """The pair's group, checksumming its pages as agreed (CRC32C on gloo, device sums on NCCL)."""
    peer = SENDER_RANK if rank == RECEIVER_RANK else RECEIVER_RANK
    if dist_backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return PairGroup(dist.ProcessGroupGloo(store, rank, 2, options), peer, torch.device("cpu"), checksum)
    if dist_backend == "nccl":
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise RuntimeError("dist_backend nccl needs CUDA and a torch build with NCCL")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = IDLE_TIMEOUT  # NCCL's watchdog would otherwise kill an idle pair
        device = torch.device("cuda", torch.cuda.current_device())
        return PairGroup(dist.ProcessGroupNCCL(store, rank, 2, options), peer, device, checksum)
    raise ValueError(f"dist_backend: expected gloo or nccl, got {dist_backend!r}")


def _local_address_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach host:port (connecting UDP sends nothing)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def raw_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on `device` (no copy when already there and contiguous)."""
    return tensor.detach().to(device).contiguous().view(torch.uint8).reshape(-1)
