"""The prefill side of the gRPC backend: one client-streaming Push call per transfer.

The sync gRPC API runs each call's request iterator on a gRPC thread, so `send` only queues and the
prefill server's event loop never blocks on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import google_crc32c
import grpc
import torch
from tandem.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from kvtransfer.descriptor import KVLayout, LayoutTransferError, TransferError, TransferTarget, check_pages
from kvtransfer.grpc_stream import MAX_PIECE_BYTES

log = logging.getLogger(__name__)

_END = object()  # queue the last chunk
_STOP = object()  # end the request stream now (aborted, or the call ended)
_Item = tuple[int, int, torch.Tensor, torch.Tensor] | object  # (layer, first block, k, v), _END or _STOP


class GrpcSender:
    """One transfer's sending end: a Push call fed from a queue. `checksum` is what its channel's
    Handshake agreed: whether every piece carries a CRC32C; `on_refused` runs when the receiver
    refuses the call with FAILED_PRECONDITION (its Handshake's answer no longer holds)."""

    def __init__(self, stub: kvtransfer_pb2_grpc.KVTransferStub, target: TransferTarget, checksum: bool,
                 on_refused: Callable[[], None]) -> None:
        self.target = target
        self.checksum = checksum
        self._on_refused = on_refused
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._call = stub.Push.future(self._chunks())
        # A call that ends early (refused, receiver gone) must not leave its iterator thread waiting.
        self._call.add_done_callback(lambda _: self._queue.put(_STOP))

    def send(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one layer's pages for blocks target.block_ids[first_block:]; never blocks."""
        check_pages(self.target, layer, first_block, k, v)
        self._queue.put((layer, first_block, k, v))

    def finish(self) -> None:
        """Queue the end marker."""
        self._queue.put(_END)

    def wait(self, timeout: float) -> int:
        """Bytes the receiver took once the call ended; TransferError on failure, or (aborting) on timeout."""
        tid = self.target.transfer_id
        try:
            return self._call.result(timeout).bytes_received
        except grpc.FutureTimeoutError:
            self.abort()
            raise TransferError(f"transfer {tid} not delivered within {timeout:g} s") from None
        except grpc.FutureCancelledError:
            raise TransferError(f"transfer {tid} was aborted") from None
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.FAILED_PRECONDITION:
                self._on_refused()
            raise TransferError(f"push of transfer {tid} failed: {e.code().name}: {e.details()}") from None

    def abort(self) -> None:
        """Give the transfer up: cancel the call (the receiver fails the transfer)."""
        self._call.cancel()

    def _chunks(self) -> Iterator[kvtransfer_pb2.KVChunk]:
        tid = self.target.transfer_id
        while (item := self._queue.get()) is not _STOP:
            if item is _END:
                yield kvtransfer_pb2.KVChunk(transfer_id=tid, last=True, crc32c=self._crc(b""))
                return
            layer, first_block, k, v = item
            for kv, tensor in enumerate((k, v)):
                raw = memoryview(tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
                for offset in range(0, len(raw), MAX_PIECE_BYTES):
                    data = bytes(raw[offset:offset + MAX_PIECE_BYTES])
                    yield kvtransfer_pb2.KVChunk(
                        transfer_id=tid, layer=layer, first_block=first_block, num_blocks=k.shape[0], kv=kv,
                        offset=offset, total_bytes=len(raw), data=data, crc32c=self._crc(data),
                    )

    def _crc(self, data: bytes) -> int | None:
        """The piece's CRC32C; None leaves the field unset (agreed off)."""
        return google_crc32c.value(data) if self.checksum else None


@dataclass
class _Channel:
    """A receiver's channel, and what its last Handshake agreed on checksums (None: ask again)."""

    channel: grpc.Channel
    stub: kvtransfer_pb2_grpc.KVTransferStub
    checksum: bool | None = None


class GrpcSenders:
    """The prefill side's gRPC channels, one per receiver address and layout, each checked by a Handshake."""

    def __init__(
        self, layout: KVLayout, timeout: float, connect: Callable[[str], grpc.Channel] = grpc.insecure_channel,
        checksum: bool = True,
    ) -> None:
        """`connect` opens a channel to a receiver's host:port (plaintext by default); `checksum`
        False (`--kv-checksum off`) asks receivers to take pieces without CRC32C."""
        self._connect = connect
        self._layout = layout
        self._timeout = timeout
        self._checksum = checksum
        self._channels: dict[tuple[str, KVLayout], _Channel] = {}
        self._lock = threading.Lock()

    def sender(self, target: TransferTarget) -> GrpcSender:
        """A sender on the receiver's channel (handshaking first on a new one; blocks up to the
        timeout). LayoutTransferError if the target's layout is not ours (before dialling) or the
        receiver holds another one (its Handshake)."""
        key = (target.address, target.layout)
        stub, checksum = self._channel(key)
        return GrpcSender(stub, target, checksum, lambda: self._ask_again(key))

    def close(self) -> None:
        """Close every channel (calls in flight fail)."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for known in channels:
            known.channel.close()

    def _channel(self, key: tuple[str, KVLayout]) -> tuple[kvtransfer_pb2_grpc.KVTransferStub, bool]:
        # Keyed by layout too. A channel reconnects by itself to a receiver restarted at the same
        # address, with no new Handshake; such a receiver's targets state its new layout, so they
        # find no channel and are checked here. Every target a channel serves is thus in the layout
        # its Handshake accepted.
        address, layout = key
        with self._lock:
            known = self._channels.get(key)
        if known is not None:
            checksum = known.checksum
            if checksum is None:
                checksum = known.checksum = self._handshake(address, known.stub)
            return known.stub, checksum
        reason = self._layout.mismatch(layout)
        if reason is not None:
            raise LayoutTransferError(address, reason)
        channel = self._connect(address)
        stub = kvtransfer_pb2_grpc.KVTransferStub(channel)
        try:
            checksum = self._handshake(address, stub)
        except TransferError:
            channel.close()
            raise
        with self._lock:
            kept = self._channels.setdefault(key, _Channel(channel, stub, checksum))
        if kept.channel is not channel:  # another thread handshook first
            channel.close()
        else:
            log.info("KV channel to %s: %s", address, self._layout.route_to(layout))
        return kept.stub, checksum

    def _ask_again(self, key: tuple[str, KVLayout]) -> None:
        # A receiver restarted at the same address (same layout) keeps the channel but may now
        # require the checksums the old one let us skip: its refusal makes the next sender on the
        # channel handshake again, instead of every later transfer failing the same way.
        with self._lock:
            known = self._channels.get(key)
            if known is not None:
                known.checksum = None

    def _handshake(self, address: str, stub: kvtransfer_pb2_grpc.KVTransferStub) -> bool:
        """Check the layouts; what the receiver decided on checksums (True: every piece carries one)."""
        request = kvtransfer_pb2.HandshakeRequest(layout=self._layout.to_proto(), checksum_off=not self._checksum)
        try:
            response = stub.Handshake(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise TransferError(f"KV handshake with {address} failed: {e.code().name}: {e.details()}") from None
        if not response.accepted:
            try:
                reason = self._layout.mismatch(KVLayout.from_proto(response.layout)) or response.reason
            except ValueError:
                reason = response.reason
            raise LayoutTransferError(address, reason)
        return not response.checksum_off
