"""The decode role: reserve KV blocks, have a prefill worker fill them, then decode in the batch."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import grpc

from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for
from engine.outputs import KVReservation, RequestOutput
from engine.resume import Resumed
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import KVLayout, TransferError, TransferTarget, WriteBlocks
from kvtransfer.receiver import KVReceiver
from services.common.engine_loop import EngineLoop
from services.common.errors import StatusError
from services.common.worker import Worker


@dataclass(frozen=True)
class PrefillReply:
    """What the prefill worker answered: the first token and where its time went."""

    first_token: int
    first_logprob: TokenLogprobs | None
    cached_tokens: int
    queue_s: float
    compute_s: float
    delivery_wait_s: float  # the prefill worker's wait, after its first token, for the pages to arrive


class PrefillPeer(Protocol):
    """The prefill worker a request uses (the gRPC client lives in the handler layer)."""

    address: str

    async def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, target: TransferTarget,
        timeout: float, resumed: Resumed | None = None,
    ) -> PrefillReply:
        """Prefill into `target` (with `resumed`: the prompt and the output already delivered);
        StatusError (passing on the prefill worker's status) on failure."""
        ...

    def abort(self, request_id: str) -> None:
        """Tell the prefill worker to drop the request (fire and forget)."""
        ...


@dataclass
class DecodeTimings:
    """Where one request's time went at this worker: durations, and the perf_counter times at which
    each stage ended (None until it did)."""

    arrived_at: float
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    kv_wait_s: float = 0.0
    kv_delivery_wait_s: float = 0.0
    # Prompt tokens this worker's own prefix cache held (they were not transferred).
    local_cached_tokens: int = 0
    # A resumed request's output delivered before it came here (not generated here).
    resumed_tokens: int = 0
    reserved_at: float | None = None
    prefill_replied_at: float | None = None
    kv_done_at: float | None = None
    joined_at: float | None = None


class DecodeWorker(Worker):
    """A decode engine plus the receiver its prompts' KV pages arrive through."""

    def __init__(
        self, address: str, engine: Engine, draining: asyncio.Event, receiver: KVReceiver, kv_timeout: float
    ) -> None:
        super().__init__(engine.config.role, address, EngineLoop(engine), draining)
        self.receiver = receiver
        self.layout = KVLayout.of_engine(engine)
        self.kv_timeout = kv_timeout
        self._transfer_ids = itertools.count(1)
        self._waiting_for_kv = 0

    @property
    def reserved_requests(self) -> int:
        return self._waiting_for_kv

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill: PrefillPeer,
        timings: DecodeTimings,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request (`resumed`: after output delivered elsewhere, whose KV the prefill worker
        computes with the prompt's): its outputs, the first token's at once. Close it (e.g. `aclosing`) to
        abandon the request: the prefill is aborted, the transfer cancelled and the blocks freed.

        Raises ValueError for bad input, StatusError RESOURCE_EXHAUSTED when the cache has no room,
        DEADLINE_EXCEEDED when the KV is not complete within `kv_timeout`, UNAVAILABLE when the
        prefill worker or the transfer failed (or the prefill worker's own status). A failure of
        the prefill worker or of its transfer names it in the StatusError's `failed_prefill`.
        """
        try:
            reservation = await self.loop.call(lambda e: _reserve(e, request_id, prompt_token_ids, params, resumed))
        except asyncio.CancelledError:
            # The engine thread may have reserved already; this abort runs after it, in order.
            self.loop.submit(lambda e: e.abort(request_id))
            raise
        timings.reserved_at = time.perf_counter()
        timings.local_cached_tokens = min(reservation.num_cached_tokens, len(prompt_token_ids))
        deadline = time.monotonic() + self.kv_timeout
        transfer_id = next(self._transfer_ids)
        self._waiting_for_kv += 1
        stage = "reserved"
        # Not cancelled with the request: a cancel must find the transfer registered, or it would
        # stay registered forever.
        expecting = asyncio.ensure_future(asyncio.to_thread(
            self.receiver.expect, prefill.address, transfer_id, reservation.blocks_to_fill,
            reservation.num_cached_tokens, self.layout, self._writer(request_id),
        ))
        try:
            try:
                target = await asyncio.shield(expecting)
            except TransferError as exc:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the KV receiver cannot take it: {exc}") from exc
            stage = "prefilling"
            try:
                reply = await prefill.prefill(request_id, prompt_token_ids, params, target, _left(deadline), resumed)
                stage = "transferring"
                timings.prefill_queue_s, timings.prefill_compute_s = reply.queue_s, reply.compute_s
                timings.kv_delivery_wait_s = reply.delivery_wait_s
                timings.prefill_replied_at = time.perf_counter()
                await self._wait_for_kv(self.receiver.completion(transfer_id), deadline, prefill.address)
            except StatusError as error:
                raise _blamed(error, prefill.address) from error
            timings.kv_done_at = time.perf_counter()
            timings.kv_wait_s = timings.kv_done_at - timings.prefill_replied_at
            queue = self.loop.open_stream(request_id)
            output = await self.loop.call(lambda e: e.start_decode(request_id, reply.first_token))
            timings.joined_at = time.perf_counter()
            self._waiting_for_kv -= 1
            stage = "decoding"
            if reply.first_logprob is not None and params.logprobs is not None:
                output = dataclasses.replace(output, logprobs=(reply.first_logprob,))
            # The prompt was computed at the prefill worker: its prefix-cache hit is what was saved.
            yield dataclasses.replace(output, num_cached_tokens=reply.cached_tokens)
            while not output.finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                output = item
                yield dataclasses.replace(output, num_cached_tokens=reply.cached_tokens)
            stage = "done"
        finally:
            self.loop.close_stream(request_id)
            if stage in ("reserved", "prefilling", "transferring"):
                self._waiting_for_kv -= 1
            if stage != "done":
                await asyncio.shield(
                    self._abandon(request_id, transfer_id, expecting, prefill if stage == "prefilling" else None)
                )

    async def generate_local(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, timings: DecodeTimings,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request with its prompt (and a resumed request's delivered output) computed here,
        chunked beside the running batch (the gateway's conditional disaggregation, and every
        request of a colocated worker). Close it to abandon the request. Raises ValueError for bad input."""
        first = True
        async for output in self.loop.generate(request_id, prompt_token_ids, params, resumed):
            if first:
                first = False
                timings.prefill_compute_s = time.perf_counter() - timings.arrived_at
            yield output

    def _writer(self, request_id: str) -> WriteBlocks:
        engine = self.loop.engine

        def write(layer: int, block_ids: Sequence[int], k, v) -> None:
            # Called on the receiver's thread, not the engine's: the reserved blocks belong to a
            # request that no step schedules until start_decode, and `receiver.cancel` returns only
            # after the last write, before the blocks are freed; so writing here races with nothing.
            engine.import_kv(request_id, layer, block_ids, k, v)

        return write

    async def _wait_for_kv(self, completion: Future[int], deadline: float, peer: str) -> None:
        waiter = asyncio.wrap_future(completion)
        # The receiver's future must never be cancelled from here (it resolves it), so wait
        # without wait_for, and keep a late failure from being reported as never retrieved.
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({waiter}, timeout=_left(deadline))
        if not done:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"the prompt's KV from {peer} was not complete within {self.kv_timeout:g} s")
        try:
            waiter.result()
        except TransferError as exc:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"KV transfer from {peer} failed: {exc}") from exc

    async def _abandon(
        self, request_id: str, transfer_id: int, expecting: asyncio.Future, prefill: PrefillPeer | None
    ) -> None:
        if prefill is not None:
            prefill.abort(request_id)
        await asyncio.wait({expecting})
        if not expecting.cancelled():
            expecting.exception()  # retrieved: it failed the request already, if it failed
        # Cancelled before the blocks are freed, so that no late page lands in a block's next owner.
        await asyncio.to_thread(self.receiver.cancel, transfer_id)
        await self.loop.call(lambda e: e.abort(request_id))

    async def close(self) -> None:
        """Stop the engine thread, then the receiver."""
        await super().close()
        await asyncio.to_thread(self.receiver.close)


def _reserve(
    engine: Engine, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, resumed: Resumed | None
) -> KVReservation:
    """On the engine thread: the reservation, or StatusError RESOURCE_EXHAUSTED when this worker
    cannot hold the prompt (now, or ever: another decode worker may have a bigger cache)."""
    resumed_tokens = len(resumed.output_token_ids) if resumed is not None else 0
    needed = blocks_for(len(prompt_token_ids) + resumed_tokens + 1, engine.kv.block_size)
    try:
        reservation = engine.reserve(request_id, prompt_token_ids, params, resumed)
    except ValueError as exc:
        if needed > engine.kv.num_blocks:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no KV room: {exc}") from exc
        raise
    if reservation is None:
        raise StatusError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no KV room: the prompt needs {needed} blocks, {engine.kv.num_free_blocks} are free",
        )
    return reservation


def _blamed(error: StatusError, prefill: str) -> StatusError:
    """`error` from the prefill worker or its transfer, naming that worker as the one that failed,
    unless it is about the request itself. A deadline here is the transfer's (`kv_timeout`), not the
    client's, so it blames the worker too."""
    if error.code is grpc.StatusCode.INVALID_ARGUMENT:
        return error
    return StatusError(error.code, error.message, failed_prefill=prefill)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
