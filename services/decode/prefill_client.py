"""The decode worker's gRPC client of prefill workers: one channel per address, reused."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from engine.kv_cache.kv_budget import KVBudget
from engine.resume import Resumed
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import TransferTarget
from services.common.channels import Channels
from services.common.convert import kept_blocks_from_proto, kv_budget_to_proto, sampling_params_to_proto
from services.common.failure import Failure, WorkerError
from services.decode.progress import PrefillFigures
from services.decode.worker import PrefillReply

log = logging.getLogger(__name__)

# The prefill worker's verdicts passed on as they are (bad input, INVALID_ARGUMENT, becomes a
# ValueError); anything else means that worker failed, which the gateway may treat by trying another.
_PASSED_ON = {
    grpc.StatusCode.FAILED_PRECONDITION: Failure.MISMATCH,
    grpc.StatusCode.NOT_FOUND: Failure.MISMATCH,  # it serves no adapter of the request's name: the wrong worker
    grpc.StatusCode.RESOURCE_EXHAUSTED: Failure.NO_ROOM,  # a colocated worker had no KV room for it now
    grpc.StatusCode.DEADLINE_EXCEEDED: Failure.DEADLINE,
    grpc.StatusCode.CANCELLED: Failure.CANCELLED,
}
_ABORT_TIMEOUT_S = 2.0


class GrpcPrefillPeer:
    """One prefill worker, as the decode worker's PrefillPeer."""

    def __init__(self, address: str, stub: prefill_pb2_grpc.PrefillStub, pending: set[asyncio.Task]) -> None:
        self.address = address
        self._stub = stub
        self._pending = pending

    async def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, target: TransferTarget,
        timeout: float, resumed: Resumed | None = None, budget: KVBudget | None = None,
        adapter_fingerprint: bytes = b"",
    ) -> PrefillReply:
        """Prefill.Prefill with a deadline; ValueError for bad input, WorkerError for other failures."""
        request = prefill_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling_params_to_proto(params),
            kv_target=target.to_proto(),
            output_token_ids=resumed.output_token_ids if resumed is not None else (),
            lora_fingerprint=adapter_fingerprint,
        )
        if budget is not None:
            request.kv_budget.CopyFrom(kv_budget_to_proto(budget))
        try:
            response = await self._stub.Prefill(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            message = f"prefill worker {self.address}: {exc.details()}"
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(message) from exc
            raise WorkerError(_PASSED_ON.get(exc.code(), Failure.UNAVAILABLE), message) from exc
        return PrefillReply(
            first_token=response.first_token_id,
            first_logprob=_logprobs(response.first_logprob) if response.HasField("first_logprob") else None,
            cached_tokens=response.cached_tokens,
            figures=PrefillFigures(response.queue_s, response.compute_s, response.kv_delivery_wait_s),
            kept=kept_blocks_from_proto(response),
        )

    def abort(self, request_id: str) -> None:
        """Prefill.Abort, fire and forget with a short deadline (a failure is only logged)."""
        task = asyncio.ensure_future(
            self._stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=_ABORT_TIMEOUT_S)
        )
        self._pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("Prefill.Abort to %s failed: %s", self.address, task.exception())


class PrefillClients:
    """Channels to the prefill workers this decode worker has used."""

    def __init__(self, channels: Channels) -> None:
        """`channels`: how the channels to the prefill workers are opened (TLS, message sizes)."""
        self._factory = channels
        self._peers: dict[str, GrpcPrefillPeer] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._pending: set[asyncio.Task] = set()

    def peer(self, address: str) -> GrpcPrefillPeer:
        """The prefill worker at host:port (its channel is opened on first use)."""
        peer = self._peers.get(address)
        if peer is None:
            channel = self._factory.open(address)
            self._channels.append(channel)
            peer = self._peers[address] = GrpcPrefillPeer(address, prefill_pb2_grpc.PrefillStub(channel), self._pending)
        return peer

    async def close(self) -> None:
        """Close every channel (pending aborts get a moment to leave first)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=_ABORT_TIMEOUT_S)
        for channel in self._channels:
            await channel.close()


def _logprobs(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple((top.token_id, top.logprob) for top in msg.top))
