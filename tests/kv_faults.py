"""Faults injected into KV transfers on the sending side, so that tests can prove each one is caught
(checksums, end-marker accounting, deadlines). Test code only: production kvtransfer/ knows nothing
of it. `install(path)` wraps, in this process, every sender a KVSenderPool makes and the transports
under them; a worker process gets it through tests/kv_fault_worker.py.

The file at `path` holds one word, `stall`, `drop` or `corrupt`, or nothing. Every transfer started
reads the file once; while it holds a word, that transfer's first page message is hit:

- drop: that message is not sent (the rest of the transfer is): the receiver finds pages missing
  when the end marker arrives;
- corrupt: one bit of its bytes flips on the wire, after the sender computed its checksum: the
  receiver's check fails (with checksums agreed off, nothing catches it);
- stall: neither it nor any later page or the end marker of that transfer is sent; only the
  deadlines end it (the sender's own abort, when its deadline passes, still goes out).

A file rather than a fixed word, so that one test process can suffer each fault in turn.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path

import grpc
import torch
from tandem.v1 import kvtransfer_pb2

from kvtransfer import torch_dist_sender
from kvtransfer.descriptor import TransferTarget
from kvtransfer.sender import KVSenderPool
from kvtransfer.transport import KVSender

log = logging.getLogger(__name__)

LOG_PREFIX = "kv fault injection"  # what the workers' logs say when a fault hits (tests look for it)
_PUSH = "/tandem.v1.KVTransfer/Push"


class Fault(Enum):
    """What happens to a transfer's first page message."""

    STALL = "stall"
    DROP = "drop"
    CORRUPT = "corrupt"


def read_fault(path: Path) -> Fault | None:
    """The fault the file asks for now (None: missing or empty); ValueError for another word."""
    try:
        word = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not word:
        return None
    try:
        return Fault(word)
    except ValueError:
        raise ValueError(f"{path} holds {word!r}, not one of stall, drop, corrupt") from None


class TransferFault:
    """The verdicts for one transfer's messages, asked in the order they are queued."""

    def __init__(self, fault: Fault | None, transfer_id: int) -> None:
        self.fault = fault
        self._transfer_id = transfer_id
        self._hit = False
        self._stalled = False

    def page_fault(self) -> Fault | None:
        """What happens to the next page message: None (it leaves as it is), DROP or STALL (it
        does not leave), CORRUPT (a bit of it flips after its checksum)."""
        if self._stalled:
            return Fault.STALL
        if self.fault is None or self._hit:
            return None
        self._hit = True
        self._stalled = self.fault is Fault.STALL
        log.warning("%s: %s of transfer %d's first pages", LOG_PREFIX, self.fault.value, self._transfer_id)
        return self.fault

    @property
    def end_allowed(self) -> bool:
        """Whether the end marker may leave (not once the transfer stalled)."""
        return not self._stalled


class Corruptions:
    """Transfers whose next page bytes on the wire get a bit flipped (once each), shared by the
    senders that mark them and the transports that flip them."""

    def __init__(self) -> None:
        self._marked: set[int] = set()
        self._lock = threading.Lock()

    def mark(self, transfer_id: int) -> None:
        with self._lock:
            self._marked.add(transfer_id)

    def take(self, transfer_id: int) -> bool:
        """Whether this transfer's bytes are to be flipped now (then no more)."""
        with self._lock:
            if transfer_id not in self._marked:
                return False
            self._marked.discard(transfer_id)
            return True


class FaultySender:
    """A KVSender that applies one transfer's TransferFault before the real sender sees its pages."""

    def __init__(self, inner: KVSender, fault: TransferFault, transfer_id: int, corruptions: Corruptions) -> None:
        self._inner = inner
        self._fault = fault
        self._transfer_id = transfer_id
        self._corruptions = corruptions
        self.checksum = inner.checksum

    def send(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        fault = self._fault.page_fault()
        if fault in (Fault.DROP, Fault.STALL):
            return
        if fault is Fault.CORRUPT:
            self._corruptions.mark(self._transfer_id)
        self._inner.send(layer, first_block, k, v)

    def finish(self) -> None:
        if self._fault.end_allowed:
            self._inner.finish()

    def wait(self, timeout: float) -> int:
        return self._inner.wait(timeout)

    def abort(self) -> None:
        self._inner.abort()


def flip_bit(data: bytearray | torch.Tensor) -> None:
    """Corrupt `data` (bytes, or a uint8 tensor on any device) in place: its first byte's lowest bit flips."""
    data[0] ^= 1


class _CorruptingPush(grpc.StreamUnaryClientInterceptor):
    """The gRPC transport's wire: the first piece with data of a marked transfer's Push leaves with a
    bit flipped (its CRC32C computed before)."""

    def __init__(self, corruptions: Corruptions) -> None:
        self._corruptions = corruptions

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        if client_call_details.method not in (_PUSH, _PUSH.encode()):
            return continuation(client_call_details, request_iterator)
        return continuation(client_call_details, self._pieces(request_iterator))

    def _pieces(self, chunks: Iterator[kvtransfer_pb2.KVChunk]) -> Iterator[kvtransfer_pb2.KVChunk]:
        for chunk in chunks:
            if chunk.data and self._corruptions.take(chunk.transfer_id):
                data = bytearray(chunk.data)
                flip_bit(data)
                chunk.data = bytes(data)
            yield chunk


def install(path: Path) -> None:
    """From now on in this process, every KVSenderPool's senders suffer what the file at `path` asks
    for: the pool's senders are wrapped (drop, stall, marking a corruption) and so are the
    transports under them (flipping the marked bits after the checksum)."""
    corruptions = Corruptions()
    pool_init, pool_sender = KVSenderPool.__init__, KVSenderPool.sender
    signature = inspect.signature(pool_init)

    def init(self: KVSenderPool, *args, **kwargs) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        connect: Callable[[str], grpc.Channel] = bound.arguments["connect"]
        bound.arguments["connect"] = lambda address: grpc.intercept_channel(connect(address),
                                                                            _CorruptingPush(corruptions))
        pool_init(*bound.args, **bound.kwargs)

    def sender(self: KVSenderPool, target: TransferTarget) -> KVSender:
        fault = TransferFault(read_fault(path), target.transfer_id)
        return FaultySender(pool_sender(self, target), fault, target.transfer_id, corruptions)

    pages_header = torch_dist_sender.pages_header

    def corrupting_pages_header(header, payload, device, checksum):
        """The torch_dist transport's wire: a marked transfer's first payload flips a bit after the
        header carrying its checksum was made."""
        made = pages_header(header, payload, device, checksum)
        if payload and corruptions.take(header.transfer_id):
            flip_bit(payload[0])
        return made

    KVSenderPool.__init__ = init  # type: ignore[method-assign]
    KVSenderPool.sender = sender  # type: ignore[method-assign]
    torch_dist_sender.pages_header = corrupting_pages_header
