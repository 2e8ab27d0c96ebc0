"""The decode side: the receiver (kvtransfer.transport.KVReceiver) of the backend a worker is configured with."""

from __future__ import annotations

from kvtransfer.grpc_stream import GrpcReceiver
from kvtransfer.torch_dist_receiver import TorchDistReceiver
from kvtransfer.transport import KVReceiver


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
