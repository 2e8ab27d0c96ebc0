"""What each KV transfer backend offers, whichever it is (grpc: kvtransfer.grpc_sender and
kvtransfer.grpc_stream; torch_dist: kvtransfer.torch_dist_sender and kvtransfer.torch_dist_receiver):
the prefill side's sender of one transfer and the decode side's receiver. The backends implement
these; the workers and the pool that picks a backend (kvtransfer.sender, kvtransfer.receiver) use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from kvtransfer.descriptor import KVLayout, TransferTarget, WriteBlocks


class KVSender(Protocol):
    """One transfer's sending end. Pages go out in the order they were queued, on a background
    thread, so the prefill model computes later layers while earlier ones travel. `checksum` is
    whether its pages carry CRC32C, as agreed when its connection was made (checksum_agreed)."""

    checksum: bool

    def send(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one layer's pages for blocks target.block_ids[first_block:first_block + len(k)];
        never blocks; takes ownership of k and v; ValueError if they do not fit the target."""
        ...

    def finish(self) -> None:
        """Queue the end marker (after every send of the transfer)."""
        ...

    def wait(self, timeout: float) -> int:
        """Block until everything queued was delivered: the bytes sent. TransferError on failure,
        or on timeout (which also aborts the transfer)."""
        ...

    def abort(self) -> None:
        """Give the transfer up; the receiver fails it."""
        ...


class KVReceiver(Protocol):
    """Accepts pushed KV pages. Writes happen on the receiver's threads through each transfer's
    `write` callback; every transfer ends by its completion, failure, cancellation or deadline."""

    backend: str

    def expect(self, peer: str, transfer_id: int, block_ids: Sequence[int], num_cached_tokens: int,
               layout: KVLayout, write: WriteBlocks) -> TransferTarget:
        """Register a transfer from `peer` (the prefill worker's address; pairs are per peer) and
        return where it must be pushed. ValueError if transfer_id is in use. Blocking-safe to call
        from asyncio through asyncio.to_thread."""
        ...

    def completion(self, transfer_id: int) -> Future[int]:
        """Bytes received once every page arrived; TransferError on failure, cancellation or deadline.
        KeyError if the transfer was never expected, or was cancelled before its future was taken."""
        ...

    def cancel(self, transfer_id: int) -> None:
        """Stop a transfer: returns after any write in progress finished, and none follows."""
        ...

    def close(self) -> None:
        """Fail every open transfer and release connections."""
        ...
