"""The prefill side of the torch_dist backend: one pair per receiver namespace, one send thread per pair."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.descriptor import KVLayout, LayoutTransferError, TransferError, TransferTarget, check_pages
from kvtransfer.futures import settle, settle_error
from kvtransfer.torch_dist import (
    IDLE_TIMEOUT,
    MAX_RUNS,
    Header,
    Kind,
    PageRun,
    PairGroup,
    join,
    pages_header,
    raw_bytes,
)

log = logging.getLogger(__name__)


class TorchDistSender:
    """One transfer's sending end: messages go, in order, through its pair's send thread."""

    def __init__(self, pair: _SendingPair, target: TransferTarget) -> None:
        self.target = target
        self.checksum = pair.checksum  # what pairing agreed
        self.done: Future[int] = Future()
        self.bytes_sent = 0
        self._pair = pair

    def send(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one layer's pages for blocks target.block_ids[first_block:]; never blocks."""
        check_pages(self.target, layer, first_block, k, v)
        run = PageRun(layer, first_block, k.shape[0], k.numel() * k.element_size())
        header = Header(Kind.PAGES, self.target.transfer_id, (run,))
        self._pair.submit(_Message(self, header, ((k, v),)))

    def finish(self) -> None:
        """Queue the end marker."""
        self._pair.submit(_Message(self, Header(Kind.END, self.target.transfer_id)))

    def wait(self, timeout: float) -> int:
        """Bytes sent once everything queued left; TransferError on failure, or (aborting) on timeout."""
        try:
            return self.done.result(timeout)
        except FutureTimeout:
            self.abort()
            raise TransferError(f"transfer {self.target.transfer_id} not delivered within {timeout:g} s") from None

    def abort(self) -> None:
        """Give the transfer up: drop what is still queued and tell the receiver."""
        if settle_error(self.done, TransferError(f"transfer {self.target.transfer_id} was aborted")):
            self._pair.submit(_Message(self, Header(Kind.ABORT, self.target.transfer_id)))


@dataclass(frozen=True)
class _Message:
    sender: TorchDistSender | None  # None: the pair's own BYE
    header: Header
    pages: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # K and V of each run in header.runs

    def joins(self, other: _Message) -> bool:
        """Whether `other` can travel in this message: more pages of the same transfer, with room."""
        return (self.header.kind is Kind.PAGES and other.header.kind is Kind.PAGES and other.sender is self.sender
                and len(self.header.runs) + len(other.header.runs) <= MAX_RUNS)

    def join(self, other: _Message) -> _Message:
        """This message with `other`'s pages appended (see `joins`)."""
        header = Header(Kind.PAGES, self.header.transfer_id, self.header.runs + other.header.runs)
        return _Message(self.sender, header, self.pages + other.pages)


_BYE = _Message(None, Header(Kind.BYE))
_WINDOW = 4  # messages posted ahead of the oldest one not known to be delivered


@dataclass(frozen=True)
class _InFlight:
    """A message whose sends are posted; the tensors stay referenced until they left."""

    sender: TorchDistSender
    header: Header
    tensors: list[torch.Tensor]
    works: list[dist.Work]

    @classmethod
    def post(cls, group: PairGroup, sender: TorchDistSender, message: _Message) -> _InFlight:
        payload = [raw_bytes(tensor, group.device) for pages in message.pages for tensor in pages]
        header = pages_header(message.header, payload, group.device, group.checksum)
        tensors = [header, *payload]
        return cls(sender, message.header, tensors, [group.post_send(tensor) for tensor in tensors])

    def complete(self, timeout: timedelta) -> None:
        """Wait until the message left; account for it; settle its transfer after END."""
        for work in self.works:
            work.wait(timeout)
        if self.header.kind is Kind.PAGES:
            self.sender.bytes_sent += self.header.nbytes
        elif self.header.kind is Kind.END:
            settle(self.sender.done, self.sender.bytes_sent)


class _SendingPair:
    """One pair's sending end. Its send thread pairs, then sends queued messages in order; a watch
    thread waits for the receiver's BYE (or the pair breaking) so a dead pair does not linger."""

    def __init__(self, target: TransferTarget, timeout: float, device: torch.device, pool: TorchDistSenders) -> None:
        self.key = _pair_key(target)
        self.ready = threading.Event()
        self.checksum = False  # whether its pages carry CRC32C, set by pairing before `ready`
        self._target = target
        self._timeout = timeout
        self._device = device if target.dist_backend == "nccl" else torch.device("cpu")
        self._pool = pool
        self._queue: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._taken: _Message | None = None  # taken off the queue while coalescing, not sent yet
        self._lock = threading.Lock()
        self._senders: set[TorchDistSender] = set()
        self._error: TransferError | None = None
        self._threads = [threading.Thread(target=self._run, name=f"kv-send-{target.address}", daemon=True)]
        self._threads[0].start()

    def open_sender(self, target: TransferTarget) -> TorchDistSender:
        """A sender for one transfer on this pair; TransferError if the pair failed or closed."""
        sender = TorchDistSender(self, target)
        with self._lock:
            if self._error is not None:
                raise self._error
            self._senders.add(sender)
        sender.done.add_done_callback(lambda _: self._forget(sender))
        return sender

    def submit(self, message: _Message) -> None:
        self._queue.put(message)

    def close(self) -> None:
        """Say BYE after what is queued; the pair ends when the receiver answers."""
        self._queue.put(_BYE)

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the pair's threads to end."""
        deadline = time.monotonic() + timeout
        self._threads[0].join(timeout)
        # Once the send thread ended, the watch thread (started by it, if it paired) is listed.
        for thread in self._threads[1:]:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _forget(self, sender: TorchDistSender) -> None:
        with self._lock:
            self._senders.discard(sender)

    def _run(self) -> None:
        target = self._target
        try:
            if target.dist_backend == "nccl" and self._device.type != "cuda":
                raise ValueError("the receiver wants nccl but this sender's KV is not on CUDA")
            group = join(target.host, target.port, target.namespace, target.dist_backend, self._timeout,
                         self._pool.host, self._pool.checksum)
        except (RuntimeError, ValueError, OSError) as e:  # torch's store errors are RuntimeErrors
            self._end(TransferError(f"pairing with the KV receiver at {target.address} failed: {e}"))
            return
        self.checksum = group.checksum
        watch = threading.Thread(target=self._watch, args=(group,), name=f"kv-watch-{target.address}", daemon=True)
        self._threads.append(watch)
        watch.start()
        self.ready.set()
        try:
            self._send_loop(group)
            group.send_header(_BYE.header, timedelta(seconds=self._timeout))
            error = TransferError(f"the KV pair with {target.address} was closed")
        except RuntimeError as e:
            error = TransferError(f"the KV pair with {target.address} broke: {e}")
        self._end(error)

    def _send_loop(self, group: PairGroup) -> None:
        """Post each message's sends at once, keeping up to _WINDOW messages in flight, so the next
        header reaches the receiver while earlier pages still travel; returns on BYE."""
        limit = timedelta(seconds=self._timeout)
        in_flight: deque[_InFlight] = deque()
        while True:
            if in_flight and (len(in_flight) >= _WINDOW or (self._taken is None and self._queue.empty())):
                in_flight.popleft().complete(limit)
                continue
            message = self._coalesced()
            if message is _BYE:
                break
            sender = message.sender
            if sender is not None and (not sender.done.done() or message.header.kind is Kind.ABORT):
                in_flight.append(_InFlight.post(group, sender, message))
        while in_flight:
            in_flight.popleft().complete(limit)

    def _coalesced(self) -> _Message:
        """The next message, with the pages of the same transfer already queued behind it joined in."""
        message = self._next()
        while self._taken is None and not self._queue.empty():
            following = self._queue.get()
            if message.joins(following):
                message = message.join(following)
            else:
                self._taken = following
        return message

    def _next(self) -> _Message:
        message, self._taken = self._taken, None
        return message if message is not None else self._queue.get()

    def _watch(self, group: PairGroup) -> None:
        try:
            header = group.recv_header(IDLE_TIMEOUT)
            log.info("KV receiver at %s closes the pair (%s)", self._target.address, header.kind.name)
        except (RuntimeError, ValueError) as e:
            log.info("KV pair with %s broke: %s", self._target.address, e)
        self.close()

    def _end(self, error: TransferError) -> None:
        """Fail every open transfer, refuse new ones, and leave the pool."""
        with self._lock:
            self._error = error
            senders = list(self._senders)
        for sender in senders:
            settle_error(sender.done, error)
        self.ready.set()
        self._pool.forget(self)


class TorchDistSenders:
    """The prefill side's torch_dist pairs, one per receiver namespace and layout."""

    def __init__(self, layout: KVLayout, timeout: float, device: torch.device, host: str | None = None,
                 checksum: bool = True) -> None:
        """`layout` is this worker's: a pair is made only with a receiver that holds it; `host` is
        the address its side of each pair listens on (None: the one that routes to the receiver);
        `checksum` is this worker's `--kv-checksum`, which pairing weighs with the receiver's."""
        self._layout = layout
        self._timeout = timeout
        self._device = device
        self.host = host
        self.checksum = checksum
        self._pairs: dict[tuple[str, KVLayout], _SendingPair] = {}
        self._lock = threading.Lock()

    def sender(self, target: TransferTarget) -> TorchDistSender:
        """A sender on the target's pair, pairing first if needed (blocks up to the timeout).
        LayoutTransferError, before pairing, if the target's layout is not ours."""
        with self._lock:
            pair = self._pairs.get(_pair_key(target))
            if pair is None:
                # The target is the receiver's word on its layout. Pairs are keyed by namespace and
                # layout, so this comparison, made once per pair, covers every target the pair
                # serves; a restarted receiver pairs again anyway, under a new namespace.
                reason = self._layout.mismatch(target.layout)
                if reason is not None:
                    raise LayoutTransferError(target.address, reason)
                pair = self._pairs[_pair_key(target)] = _SendingPair(target, self._timeout, self._device, self)
                log.info("KV pair with %s: %s", target.address, self._layout.route_to(target.layout))
        # Pairing gives up by itself after the timeout; the margin covers thread start-up.
        if not pair.ready.wait(2 * self._timeout):
            raise TransferError(f"pairing with the KV receiver at {target.address} did not finish")
        return pair.open_sender(target)

    def forget(self, pair: _SendingPair) -> None:
        """Drop an ended pair: a later target for the same receiver comes with a new namespace."""
        with self._lock:
            if self._pairs.get(pair.key) is pair:
                del self._pairs[pair.key]

    def close(self) -> None:
        """Close every pair after what is queued and wait (up to the timeout) for their threads.
        Call it before the process exits: a process that exits while a thread is blocked in gloo
        aborts (std::terminate)."""
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.close()
        deadline = time.monotonic() + self._timeout
        for pair in pairs:
            pair.join(max(0.0, deadline - time.monotonic()))


def _pair_key(target: TransferTarget) -> tuple[str, KVLayout]:
    return target.namespace, target.layout
