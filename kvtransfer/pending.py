"""The receiver's table of expected transfers, shared by both backends.

It decodes raw page bytes, calls each transfer's write callback, checks on the end marker that
every layer of every expected block arrived, and fails transfers that miss their deadline. Each
transfer has its own lock held around its writes, so `cancel` can promise that no write for that
transfer starts after it returns (lock order: a transfer's lock, then the table's; the table's
lock is never held while waiting for a transfer's).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvtransfer.descriptor import KVLayout, TransferError, WriteBlocks
from kvtransfer.futures import settle, settle_error

_MAX_TRANSFER_ID = 2**63 - 1  # transfer ids travel in int64 headers


@dataclass(eq=False)
class _Transfer:
    transfer_id: int
    peer: str
    block_ids: tuple[int, ...]
    layout: KVLayout
    write: WriteBlocks
    future: Future[int] = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # One flag per (layer, block index): which pages have arrived.
    arrived: bytearray = field(init=False)
    bytes_received: int = 0
    open: bool = True
    claimed: bool = False

    def __post_init__(self) -> None:
        self.arrived = bytearray(self.layout.num_layers * len(self.block_ids))


class PendingTransfers:
    """Expected transfers of one receiver, each with a completion future and a deadline."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Condition()
        self._transfers: dict[int, _Transfer] = {}
        # Futures of transfers that ended before `completion` was asked for them.
        self._unclaimed: dict[int, Future[int]] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._closed = False
        threading.Thread(target=self._expire_loop, name="kv-deadlines", daemon=True).start()

    def add(self, peer: str, transfer_id: int, block_ids: Sequence[int], layout: KVLayout,
            write: WriteBlocks) -> None:
        """Expect a transfer from `peer`; ValueError if its id is in use or out of range."""
        if not 0 <= transfer_id <= _MAX_TRANSFER_ID:
            raise ValueError(f"transfer_id: {transfer_id} is outside [0, 2**63)")
        transfer = _Transfer(transfer_id, peer, tuple(block_ids), layout, write)
        with self._lock:
            if self._closed:
                raise TransferError("the KV receiver is closed")
            if transfer_id in self._transfers or transfer_id in self._unclaimed:
                raise ValueError(f"transfer_id: {transfer_id} is already in use")
            self._transfers[transfer_id] = transfer
            heapq.heappush(self._deadlines, (time.monotonic() + self.timeout, transfer_id))
            self._lock.notify()

    def expected(self, transfer_id: int) -> tuple[int, KVLayout] | None:
        """How many destination blocks an open transfer has, and the layout its pages have; None once
        it is not open (or unknown)."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            return None if transfer is None else (len(transfer.block_ids), transfer.layout)

    def completion(self, transfer_id: int) -> Future[int]:
        """The transfer's future (bytes received, or TransferError); KeyError if never expected."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is not None:
                transfer.claimed = True
                return transfer.future
            return self._unclaimed.pop(transfer_id)

    def write(self, transfer_id: int, layer: int, first_block: int, num_blocks: int,
              k_raw: torch.Tensor, v_raw: torch.Tensor) -> None:
        """Hand one layer's pages (raw uint8 bytes) to the transfer's write callback.

        Pages of a transfer that is unknown, cancelled or failed are dropped; pages that do not fit
        the transfer, or a failing callback, fail it.
        """
        with self._lock:
            transfer = self._transfers.get(transfer_id)
        if transfer is None:
            return
        with transfer.lock:
            if not transfer.open:
                return
            try:
                k, v = _decode(transfer, layer, first_block, num_blocks, k_raw, v_raw)
                transfer.write(layer, transfer.block_ids[first_block:first_block + num_blocks], k, v)
            except Exception as e:
                self._close(transfer, TransferError(f"transfer {transfer_id}, layer {layer}: {e}"))
                return
            start = layer * len(transfer.block_ids) + first_block
            transfer.arrived[start:start + num_blocks] = b"\x01" * num_blocks
            transfer.bytes_received += k_raw.numel() + v_raw.numel()

    def finish(self, transfer_id: int) -> int:
        """The end marker arrived: complete the transfer if every page did; bytes received.

        TransferError (which also fails the transfer) if pages are missing or it is not open.
        """
        with self._lock:
            transfer = self._transfers.get(transfer_id)
        if transfer is None:
            raise TransferError(f"transfer {transfer_id} is unknown, cancelled or failed")
        with transfer.lock:
            if not transfer.open:
                raise TransferError(f"transfer {transfer_id} is cancelled or failed")
            missing = transfer.arrived.count(0)
            if missing:
                error = TransferError(f"transfer {transfer_id} ended with {missing} of "
                                      f"{len(transfer.arrived)} (layer, block) pages missing")
                self._close(transfer, error)
                raise error
            self._close(transfer, None)
            return transfer.bytes_received

    def fail(self, transfer_id: int, error: TransferError) -> None:
        """Fail one transfer (no effect if it already ended)."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
        if transfer is not None:
            with transfer.lock:
                self._close(transfer, error)

    def fail_peer(self, peer: str, error: TransferError) -> None:
        """Fail every open transfer expected from `peer`."""
        with self._lock:
            transfers = [t for t in self._transfers.values() if t.peer == peer]
        for transfer in transfers:
            with transfer.lock:
                self._close(transfer, error)

    def cancel(self, transfer_id: int) -> None:
        """Stop a transfer; returns after any write in progress for it finished, and none follows."""
        with self._lock:
            self._unclaimed.pop(transfer_id, None)
            transfer = self._transfers.get(transfer_id)
        if transfer is not None:
            with transfer.lock:
                transfer.claimed = True  # the caller gave it up: keep no future for it
                self._close(transfer, TransferError(f"transfer {transfer_id} was cancelled"))

    def close(self) -> None:
        """Fail every open transfer and stop the deadline thread."""
        with self._lock:
            self._closed = True
            transfers = list(self._transfers.values())
            self._lock.notify()
        for transfer in transfers:
            with transfer.lock:
                self._close(transfer, TransferError("the KV receiver closed"))

    def _close(self, transfer: _Transfer, error: TransferError | None) -> None:
        """End an open transfer; the caller holds its lock."""
        if not transfer.open:
            return
        transfer.open = False
        with self._lock:
            del self._transfers[transfer.transfer_id]
            if not transfer.claimed:
                self._unclaimed[transfer.transfer_id] = transfer.future
        if error is None:
            settle(transfer.future, transfer.bytes_received)
        else:
            settle_error(transfer.future, error)

    def _expire_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    expired.append(heapq.heappop(self._deadlines)[1])
                if not expired:
                    self._lock.wait(self._deadlines[0][0] - now if self._deadlines else None)
                    continue
            # fail() takes each transfer's lock, which must not be awaited under the table's.
            for transfer_id in expired:
                self.fail(transfer_id, TransferError(
                    f"transfer {transfer_id}: KV not complete within {self.timeout:g} s"))


def _decode(transfer: _Transfer, layer: int, first_block: int, num_blocks: int,
            k_raw: torch.Tensor, v_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw page bytes -> K and V tensors; ValueError if they do not fit the transfer."""
    layout = transfer.layout
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer {layer} is outside [0, {layout.num_layers})")
    if num_blocks < 1 or first_block < 0 or first_block + num_blocks > len(transfer.block_ids):
        raise ValueError(f"blocks [{first_block}, {first_block + num_blocks}) are outside the "
                         f"{len(transfer.block_ids)} expected")
    expected = num_blocks * layout.block_bytes
    if k_raw.numel() != expected or v_raw.numel() != expected:
        raise ValueError(f"expected {expected} bytes each for K and V, got {k_raw.numel()} and {v_raw.numel()}")
    shape = (num_blocks, *layout.block_shape)
    return k_raw.view(layout.torch_dtype).view(shape), v_raw.view(layout.torch_dtype).view(shape)
