"""The decode side of the torch_dist backend: one pair per prefill peer, one receive thread per pair."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta

import torch

from kvtransfer.descriptor import KVLayout, TransferError, TransferTarget, WriteBlocks
from kvtransfer.pending import PendingTransfers
from kvtransfer.torch_dist import IDLE_TIMEOUT, Header, Kind, PairGroup, Rendezvous, checksum_name, payload_checksum

log = logging.getLogger(__name__)


class _ReceivingPair:
    """One pair's receiving end: pairs with the peer on its own thread, then reads messages in order."""

    def __init__(self, peer: str, bind_host: str, dist_backend: str, pending: PendingTransfers,
                 on_end: Callable[[_ReceivingPair, TransferError], None], checksum: bool) -> None:
        self.peer = peer
        self.namespace = secrets.token_hex(16)
        self.dist_backend = dist_backend
        self.rendezvous = Rendezvous(bind_host, self.namespace, pending.timeout, checksum)
        self._timeout = timedelta(seconds=pending.timeout)
        self._pending = pending
        self._on_end = on_end
        self._stop = threading.Event()
        self._group: PairGroup | None = None
        self._bye_lock = threading.Lock()
        self._bye_sent = False
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{peer}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop pairing, or ask the peer to close the pair; the thread ends on the peer's answer."""
        self._stop.set()
        self._say_bye()

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the thread to end."""
        self._thread.join(timeout)

    def _say_bye(self) -> None:
        with self._bye_lock:
            if self._bye_sent or self._group is None:
                return
            self._bye_sent = True
        try:
            self._group.send_header(Header(Kind.BYE), self._timeout)
        except RuntimeError as e:
            log.debug("KV pair with %s: BYE not sent: %s", self.peer, e)

    def _run(self) -> None:
        try:
            group = self.rendezvous.accept(self.dist_backend, self._stop)
            with self._bye_lock:
                self._group = group
            if self._stop.is_set():  # closed while the group was being built
                self._say_bye()
            self._receive_loop(group)
            error = TransferError(f"the KV pair with {self.peer} was closed")
        except (RuntimeError, ValueError) as e:  # gloo reports a broken pair as RuntimeError
            error = TransferError(f"the KV pair with {self.peer} broke: {e}")
        self._on_end(self, error)

    def _receive_loop(self, group: PairGroup) -> None:
        """Handle messages until the pair closes.

        A PAGES header makes it post the receives of every page run it lists together with the
        next header's, so the sender waits for one round trip per message, not one per tensor.
        Pages are written into the cache once the next header arrived, while that message's pages
        travel (a gloo receive cannot be polled, so waiting for the next header is the only way to
        know more is coming); END, ABORT and BYE write what is held first, so a finished transfer
        is fully written.
        """
        header_buffer = group.header_buffer()
        next_header = group.post_recv(header_buffer)
        held: tuple[Header, list[torch.Tensor]] | None = None
        while True:
            next_header.wait(IDLE_TIMEOUT)
            header = Header.parse(header_buffer)
            if header.kind is Kind.PAGES:
                buffers = [torch.empty(run.nbytes, dtype=torch.uint8, device=group.device)
                           for run in header.runs for _ in ("k", "v")]
                pages = [group.post_recv(buffer) for buffer in buffers]
                next_header = group.post_recv(header_buffer)
                if held is not None:
                    self._write(group, *held)
                for work in pages:
                    work.wait(self._timeout)
                held = (header, buffers)
                continue
            if held is not None:
                self._write(group, *held)
                held = None
            if header.kind is Kind.BYE:
                self._say_bye()
                return
            self._handle_end(header)
            next_header = group.post_recv(header_buffer)

    def _write(self, group: PairGroup, header: Header, buffers: list[torch.Tensor]) -> None:
        """Check the pages (a checksum the pair agreed on must be there and match), then write them."""
        layers = sorted({run.layer for run in header.runs})
        if header.checksum is None and group.checksum:
            self._pending.fail(header.transfer_id, TransferError(
                f"transfer {header.transfer_id}: the pages of layers {layers} from {self.peer} came without the "
                f"{checksum_name(group.device)} this pair agreed on"))
            return
        if header.checksum is not None and payload_checksum(buffers) != header.checksum:
            self._pending.fail(header.transfer_id, TransferError(
                f"transfer {header.transfer_id}: {checksum_name(group.device)} mismatch in the pages of layers "
                f"{layers} from {self.peer}"))
            return
        for i, run in enumerate(header.runs):
            self._pending.write(header.transfer_id, run.layer, run.first_block, run.num_blocks,
                                buffers[2 * i], buffers[2 * i + 1])

    def _handle_end(self, header: Header) -> None:
        """An END or ABORT message."""
        if header.kind is Kind.END:
            try:
                self._pending.finish(header.transfer_id)
            except TransferError as e:  # finish() already failed the transfer with it
                log.debug("%s", e)
        elif header.kind is Kind.ABORT:
            self._pending.fail(header.transfer_id, TransferError(
                f"transfer {header.transfer_id} was aborted by the sender {self.peer}"))
        else:
            raise ValueError(f"unexpected {header.kind.name} message")


class TorchDistReceiver:
    """KVReceiver over pairwise torch.distributed groups (see kvtransfer.torch_dist)."""

    backend = "torch_dist"

    def __init__(self, bind_host: str, timeout: float = 30.0, dist_backend: str = "gloo",
                 checksum: bool = True) -> None:
        """Rendezvous stores listen on `bind_host` only; `timeout` bounds pairing, each message once
        started, and each transfer from `expect` to its end; `checksum` False (`--kv-checksum off`)
        lets pairs whose sender is off too go without CRC32C."""
        self._bind_host = bind_host
        self._dist_backend = dist_backend
        self._checksum = checksum
        self._pending = PendingTransfers(timeout)
        self._pairs: dict[str, _ReceivingPair] = {}
        self._lock = threading.Lock()

    def expect(self, peer: str, transfer_id: int, block_ids: Sequence[int], num_cached_tokens: int,
               layout: KVLayout, write: WriteBlocks) -> TransferTarget:
        """Register a transfer from `peer` (pairing with it first if needed); its target."""
        with self._lock:
            pair = self._pairs.get(peer)
            if pair is None:
                pair = _ReceivingPair(peer, self._bind_host, self._dist_backend, self._pending, self._pair_ended,
                                      self._checksum)
                self._pairs[peer] = pair
            # Under the lock: a pair that breaks now fails this transfer too (see _pair_ended).
            self._pending.add(peer, transfer_id, block_ids, layout, write)
        return TransferTarget(layout, transfer_id, tuple(block_ids), num_cached_tokens, "torch_dist",
                              pair.rendezvous.host, pair.rendezvous.port, pair.namespace, pair.dist_backend)

    def completion(self, transfer_id: int) -> Future[int]:
        """Bytes received once complete; TransferError on failure, cancellation or deadline."""
        return self._pending.completion(transfer_id)

    def cancel(self, transfer_id: int) -> None:
        """Stop a transfer; no write for it runs after this returns."""
        self._pending.cancel(transfer_id)

    def close(self) -> None:
        """Fail open transfers, close every pair and wait (up to the timeout) for their threads.
        Call it before the process exits: a process that exits while a thread is blocked in gloo
        aborts (std::terminate)."""
        self._pending.close()
        with self._lock:
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.close()
        deadline = time.monotonic() + self._pending.timeout
        for pair in pairs:
            pair.join(max(0.0, deadline - time.monotonic()))

    def _pair_ended(self, pair: _ReceivingPair, error: TransferError) -> None:
        log.info("%s", error)
        with self._lock:
            if self._pairs.get(pair.peer) is pair:
                del self._pairs[pair.peer]
            # The next expect() for this peer pairs again, under a new namespace.
            self._pending.fail_peer(pair.peer, error)
