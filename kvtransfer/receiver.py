"""The decode side: receivers that accept KV pages into reserved blocks, common to both backends."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from kvtransfer.descriptor import KVLayout, TransferTarget, WriteBlocks
from kvtransfer.grpc_stream import GrpcReceiver
from kvtransfer.torch_dist_receiver import TorchDistReceiver


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


def make_receiver(backend: str, bind_host: str, grpc_address: str, *, timeout: float = 30.0,
                  device: str = "cpu", checksum: bool = True) -> KVReceiver:
    """The receiver for `backend`. torch_dist hosts pairing stores on `bind_host` (ephemeral ports;
    NCCL when `device` is CUDA, else gloo); grpc names `grpc_address`, this worker's gRPC server,
    which must register KVTransferServicer. `timeout` bounds each transfer from expect() to its end.
    `checksum` (`--kv-checksum`) True requires CRC32C on every page; False lets pages go without one
    from senders whose setting is off too (kvtransfer.descriptor.checksum_agreed)."""
    if backend == "torch_dist":
        return TorchDistReceiver(bind_host, timeout, "nccl" if device.startswith("cuda") else "gloo", checksum)
    if backend == "grpc":
        return GrpcReceiver(grpc_address, timeout, checksum)
    raise ValueError(f"kv_backend: expected torch_dist or grpc, got {backend!r}")
