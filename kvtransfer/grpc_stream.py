"""The gRPC backend's receiving end: the KVTransfer service (Handshake, Push) and its KVReceiver.

A Push call carries one transfer: KVChunk pieces of at most MAX_PIECE_BYTES, each with a CRC32C of
its bytes unless the channel's Handshake agreed on none (kvtransfer.descriptor.checksum_agreed: both
sides' `--kv-checksum` off). Per layer and block range the sender sends all of K, then all of V, in order; the
service joins the pieces and hands whole pages to the transfer's write callback off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future

import google_crc32c
import grpc
import torch
from tandem.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from kvtransfer.descriptor import (
    KVLayout,
    TransferError,
    TransferTarget,
    WriteBlocks,
    checksum_agreed,
    split_address,
)
from kvtransfer.pending import PendingTransfers
from kvtransfer.transport import KVReceiver

MAX_PIECE_BYTES = 2 * 1024 * 1024

Pages = tuple[int, int, int, torch.Tensor, torch.Tensor]  # layer, first_block, num_blocks, k bytes, v bytes


class GrpcReceiver:
    """KVReceiver whose pages arrive through this worker's own KVTransfer service."""

    backend = "grpc"

    def __init__(self, grpc_address: str, timeout: float = 30.0, checksum: bool = True) -> None:
        """`grpc_address` is where senders reach this worker's gRPC server; `timeout` bounds each
        transfer; `checksum` (its `--kv-checksum`) False lets senders that ask skip the CRC32C."""
        self.host, self.port = split_address(grpc_address)
        self.pending = PendingTransfers(timeout)
        self.checksum = checksum

    def expect(self, peer: str, transfer_id: int, block_ids: Sequence[int], num_cached_tokens: int,
               layout: KVLayout, write: WriteBlocks) -> TransferTarget:
        """Register a transfer; its target names this worker's KVTransfer service."""
        self.pending.add(peer, transfer_id, block_ids, layout, write)
        return TransferTarget(layout, transfer_id, tuple(block_ids), num_cached_tokens, "grpc", self.host, self.port)

    def completion(self, transfer_id: int) -> Future[int]:
        """Bytes received once complete; TransferError on failure, cancellation or deadline."""
        return self.pending.completion(transfer_id)

    def cancel(self, transfer_id: int) -> None:
        """Stop a transfer; no write for it runs after this returns."""
        self.pending.cancel(transfer_id)

    def close(self) -> None:
        """Fail every open transfer."""
        self.pending.close()


class _Refusal(Exception):
    """Ends a Push call with a status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _PageAssembly:
    """Joins one transfer's pieces into whole K and V byte tensors."""

    def __init__(self, layout: KVLayout, max_blocks: int) -> None:
        self._layout = layout
        self._max_blocks = max_blocks
        self._key: tuple[int, int, int] | None = None  # (layer, first_block, num_blocks) being joined
        self._parts: list[bytearray] = []  # K, then V once K is whole
        self._filled = 0  # bytes of the last part received so far

    def add(self, chunk: kvtransfer_pb2.KVChunk) -> Pages | None:
        """Take one piece; the pages once their V is whole; ValueError if the piece does not fit."""
        key = (chunk.layer, chunk.first_block, chunk.num_blocks)
        if chunk.offset == 0:
            self._start(key, chunk)
        elif key != self._key or chunk.kv != len(self._parts) - 1 or chunk.offset != self._filled:
            raise ValueError(f"piece at offset {chunk.offset} of layer {chunk.layer} arrived out of order")
        part = self._parts[-1]
        end = self._filled + len(chunk.data)
        if end > len(part) or chunk.total_bytes != len(part):
            raise ValueError(f"piece at offset {chunk.offset} overflows its {len(part)}-byte tensor")
        part[self._filled:end] = chunk.data
        self._filled = end
        if chunk.kv == 1 and end == len(part):
            k, v = (torch.frombuffer(p, dtype=torch.uint8) for p in self._parts)
            self._key, self._parts = None, []
            return (*key, k, v)
        return None

    def _start(self, key: tuple[int, int, int], chunk: kvtransfer_pb2.KVChunk) -> None:
        k_whole = len(self._parts) == 1 and self._filled == len(self._parts[0]) and key == self._key
        if not ((chunk.kv == 0 and not self._parts) or (chunk.kv == 1 and k_whole)):
            raise ValueError(f"{'KV'[min(chunk.kv, 1)]} of layer {chunk.layer} started out of order")
        if not 1 <= chunk.num_blocks <= self._max_blocks:
            raise ValueError(f"num_blocks {chunk.num_blocks} is outside [1, {self._max_blocks}]")
        size = chunk.num_blocks * self._layout.block_bytes
        if chunk.total_bytes != size:
            raise ValueError(f"total_bytes {chunk.total_bytes} != {size} for {chunk.num_blocks} blocks")
        self._key = key
        self._parts.append(bytearray(size))
        self._filled = 0


class _Push:
    """The receiving state of one Push call."""

    def __init__(self, pending: PendingTransfers, checksum: bool) -> None:
        self._pending = pending
        self._checksum = checksum  # every piece must carry a CRC32C
        self.transfer_id: int | None = None
        self._assembly: _PageAssembly | None = None

    async def handle(self, chunk: kvtransfer_pb2.KVChunk) -> int | None:
        """Take one chunk; the bytes received once the transfer completed; _Refusal if it cannot go on."""
        tid = chunk.transfer_id
        if self.transfer_id is None:
            self.transfer_id = tid
        elif tid != self.transfer_id:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                           f"chunk of transfer {tid} in the push of {self.transfer_id}")
        expected = self._pending.expected(tid)
        if expected is None:
            raise _Refusal(grpc.StatusCode.NOT_FOUND if self._assembly is None else grpc.StatusCode.ABORTED,
                           f"transfer {tid} is not expected here (unknown, cancelled, failed or timed out)")
        if not chunk.HasField("crc32c"):
            if self._checksum:
                raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {tid}: a piece of layer {chunk.layer} came without CRC32C, which this "
                               "receiver requires (--kv-checksum on)")
        elif google_crc32c.value(chunk.data) != chunk.crc32c:
            raise _Refusal(grpc.StatusCode.DATA_LOSS, f"transfer {tid}: CRC32C mismatch in layer {chunk.layer}, "
                                                      f"{'KV'[min(chunk.kv, 1)]} bytes at offset {chunk.offset}")
        self._assembly = self._assembly or _PageAssembly(expected[1], expected[0])
        if chunk.data or not chunk.last:
            try:
                pages = self._assembly.add(chunk)
            except ValueError as e:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"transfer {tid}: {e}") from None
            if pages is not None:
                await asyncio.to_thread(self._pending.write, tid, *pages)
        if not chunk.last:
            return None
        try:
            return self._pending.finish(tid)
        except TransferError as e:
            raise _Refusal(grpc.StatusCode.DATA_LOSS, str(e)) from None

    def fail(self, reason: str) -> None:
        """Fail the transfer, if one started (no effect once it ended)."""
        if self.transfer_id is not None:
            self._pending.fail(self.transfer_id, TransferError(reason))


class KVTransferServicer(kvtransfer_pb2_grpc.KVTransferServicer):
    """grpc.aio KVTransfer service of a decode worker: layout checks for any backend, and pushed
    pages for a GrpcReceiver (other receivers refuse Push).

    `layouts` are those it accepts: the worker's, and during a hot swap in its process also the
    retiring version's (services.decode.model_swap sets them); a mismatch is told against the first.
    """

    def __init__(self, layout: KVLayout, receiver: KVReceiver | None) -> None:
        self.layouts: tuple[KVLayout, ...] = (layout,)
        self._receiver = receiver if isinstance(receiver, GrpcReceiver) else None

    async def Handshake(
        self, request: kvtransfer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.HandshakeResponse:
        """Accept the caller's layout if it equals ours, else name the differing fields; decide
        whether the caller's pieces carry a CRC32C (checksum_agreed)."""
        layout = self.layouts[0]
        try:
            theirs = KVLayout.from_proto(request.layout)
            layout = next((ours for ours in self.layouts if ours.mismatch(theirs) is None), layout)
            reason = layout.mismatch(theirs)
        except ValueError as e:
            reason = str(e)
        # A worker that receives no KV over grpc takes no pieces: the safe answer costs nothing.
        required = self._receiver is None or self._receiver.checksum
        checksum = checksum_agreed(required, not request.checksum_off)
        return kvtransfer_pb2.HandshakeResponse(
            accepted=reason is None, reason=reason or "", layout=layout.to_proto(), checksum_off=not checksum
        )

    async def Push(
        self, request_iterator: AsyncIterator[kvtransfer_pb2.KVChunk], context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.PushResponse:
        """Write one transfer's pages; DATA_LOSS on a CRC mismatch or missing pages,
        FAILED_PRECONDITION on a piece without CRC32C when this receiver requires one."""
        if self._receiver is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker does not receive KV over grpc")
        push = _Push(self._receiver.pending, self._receiver.checksum)
        try:
            async for chunk in request_iterator:
                received = await push.handle(chunk)
                if received is not None:
                    return kvtransfer_pb2.PushResponse(bytes_received=received)
            raise _Refusal(grpc.StatusCode.ABORTED,
                           f"the push of transfer {push.transfer_id} ended before its last chunk")
        except _Refusal as e:
            push.fail(e.message)
            await context.abort(e.code, e.message)
        except BaseException as e:  # cancelled by the sender, or the stream broke
            push.fail(f"the push of transfer {push.transfer_id} stopped: {e!r}")
            raise
