"""The prefill side: senders (kvtransfer.transport.KVSender) that push one request's KV pages to the
receiver that reserved them, on whichever backend the receiver named."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import torch

from kvtransfer.descriptor import KVLayout, TransferTarget
from kvtransfer.grpc_sender import GrpcSenders
from kvtransfer.torch_dist_sender import TorchDistSenders
from kvtransfer.transport import KVSender


class KVSenderPool:
    """The prefill worker's senders: one pairwise connection per receiver, reused across requests."""

    def __init__(
        self,
        layout: KVLayout,
        timeout: float = 30.0,
        device: str = "cpu",
        connect: Callable[[str], grpc.Channel] = grpc.insecure_channel,
        host: str | None = None,
        checksum: bool = True,
    ) -> None:
        """`layout` is this worker's; `timeout` bounds pairing, handshakes and each message;
        `device` is where the exported KV lives (NCCL targets need it on CUDA); `connect` opens the
        gRPC backend's channel to a receiver's host:port (e.g. with mutual TLS); `host` is the
        address this side of a torch_dist pair listens on (None: the one that routes to the receiver);
        `checksum` False (`--kv-checksum off`) skips the CRC32C where the receiver allows it too."""
        self._torch_dist = TorchDistSenders(layout, timeout, torch.device(device), host, checksum)
        self._grpc = GrpcSenders(layout, timeout, connect, checksum)

    def sender(self, target: TransferTarget) -> KVSender:
        """A sender for one transfer, on the pair for the target's receiver and layout. Pairing checks
        the layouts (LayoutTransferError, naming the fields, before any page is sent), and a pair
        serves only targets of the layout it was made for, so each target is covered by that one
        check. TransferError if the receiver cannot be reached. May block while pairing: call it off
        the event loop."""
        if target.backend == "torch_dist":
            return self._torch_dist.sender(target)
        return self._grpc.sender(target)

    def close(self) -> None:
        """Close every connection after what is queued (waiting up to the timeout); transfers still
        in flight fail. Call it before the process exits (see TorchDistSenders.close)."""
        self._torch_dist.close()
        self._grpc.close()
