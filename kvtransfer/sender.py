"""The prefill side: senders that push one request's KV pages to the receiver that reserved them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import grpc
import torch

from kvtransfer.descriptor import KVLayout, TransferTarget
from kvtransfer.grpc_sender import GrpcSenders
from kvtransfer.torch_dist_sender import TorchDistSenders


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
