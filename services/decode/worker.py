"""The decode role: reserve KV blocks, have a prefill worker fill them, then decode in the batch.

Transport-free: failures are WorkerErrors (and ValueError for bad input), which the handler maps
to gRPC statuses; the prefill worker is reached through a `PrefillPeer` the handler layer provides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from engine.commands import Abort, ImportPages, Reserve, StartDecode
from engine.engine import Engine
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.outputs import KVReservation, RequestOutput, ReserveResult
from engine.resume import Resumed
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import KVLayout, TransferError, TransferTarget, WriteBlocks
from kvtransfer.sender import KVSenderPool
from kvtransfer.transport import KVReceiver
from services.common.engine_loop import EngineLoop
from services.common.failure import Failure, WorkerError
from services.common.prefill_site import PrefillSite
from services.common.worker import RoleWorker
from services.decode.progress import DecodeProgress, DecodeStage, PrefillFigures

# The engine's own deadline for a reservation frees its blocks even if this worker never ends the
# request; it passes after the worker's (`kv_timeout`), so that the worker's DEADLINE answers first.
_ENGINE_BACKSTOP = 2.0


@dataclass(frozen=True)
class PrefillReply:
    """What the prefill worker answered: the first token and where its time went."""

    first_token: int
    first_logprob: TokenLogprobs | None
    cached_tokens: int
    figures: PrefillFigures
    kept: KeptBlocks | None = None  # under the request's KV budget: the blocks pushed


class PrefillPeer(Protocol):
    """The prefill worker a request uses (the gRPC client lives in the handler layer)."""

    address: str

    async def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, target: TransferTarget,
        timeout: float, resumed: Resumed | None = None, budget: KVBudget | None = None,
        adapter_fingerprint: bytes = b"",
    ) -> PrefillReply:
        """Prefill into `target` (with `resumed`: the prompt and the output already delivered;
        under `budget`, a target of only the blocks the prompt keeps, which the reply names), under
        the LoRA adapter of `params.lora_name` with this fingerprint (b"": the base);
        ValueError if the prefill worker found the request bad, WorkerError on any other failure."""
        ...

    def abort(self, request_id: str) -> None:
        """Tell the prefill worker to drop the request (fire and forget)."""
        ...


class DecodeWorker(RoleWorker):
    """A decode engine plus the receiver its prompts' KV pages arrive through; a colocated one also
    computes prompts for other workers (its prefill site)."""

    def __init__(
        self, address: str, engine: Engine, draining: asyncio.Event, receiver: KVReceiver, kv_timeout: float,
        on_fatal: Callable[[str], None] | None = None, transfer_ids: Iterator[int] | None = None,
        senders: Callable[[KVLayout], KVSenderPool] | None = None,
    ) -> None:
        """`on_fatal(reason)`: the engine can never step again (services.common.engine_loop).
        `transfer_ids`: the receiver's transfer numbering, when another worker shares the receiver.
        `senders`: the connections to other workers' KV receivers for an engine's layout, where this
        worker computes prompts for them (None: it does not)."""
        super().__init__(engine.config.role, address, EngineLoop(engine, on_fatal=on_fatal), draining)
        self.receiver = receiver
        self.layout = KVLayout.of_engine(engine)
        self.kv_timeout = kv_timeout
        self._senders = senders
        if senders is not None:
            self.prefill_site = PrefillSite(self.loop, senders(self.layout), kv_timeout)
        self._address = address
        self._on_fatal = on_fatal
        self._transfer_ids = transfer_ids or itertools.count(1)
        self._waiting_for_kv = 0

    def successor(self, engine: Engine) -> DecodeWorker:
        """A worker for another engine (a hot swap's new version) taking KV through the same receiver,
        beside this one; its loop is not started yet."""
        return DecodeWorker(self._address, engine, self.draining, self.receiver, self.kv_timeout,
                            self._on_fatal, self._transfer_ids, self._senders)

    @property
    def reserved_requests(self) -> int:
        return self._waiting_for_kv

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill: PrefillPeer,
        progress: DecodeProgress,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request (`resumed`: after output delivered elsewhere, whose KV the prefill worker
        computes with the prompt's): its outputs, the first token's at once. Close it (e.g. `aclosing`) to
        abandon the request: the prefill is aborted, the transfer cancelled and the blocks freed.

        Raises ValueError for bad input, WorkerError NO_ROOM when the cache has no room (or a colocated
        prefill worker has none for the prompt now), DEADLINE when the KV is not complete within
        `kv_timeout`, UNAVAILABLE when the prefill worker or the transfer failed (or the prefill
        worker's own failure). A failure or refusal of the prefill worker or of its transfer names it
        in the WorkerError's `failed_prefill`.
        """
        try:
            reservation = _reservation(await self.loop.call(
                Reserve(request_id, prompt_token_ids, params, resumed, _ENGINE_BACKSTOP * self.kv_timeout)))
        except asyncio.CancelledError:
            # The engine thread may have reserved already; this abort runs after it, in order.
            self.loop.submit(Abort(request_id))
            raise
        progress.enter(DecodeStage.RESERVED, time.perf_counter())
        progress.local_cached_tokens = min(reservation.num_cached_tokens, len(prompt_token_ids))
        deadline = time.monotonic() + self.kv_timeout
        transfer_id = next(self._transfer_ids)
        self._waiting_for_kv += 1
        # Not cancelled with the request: a cancel must find the transfer registered, or it would
        # stay registered forever.
        expecting = asyncio.ensure_future(asyncio.to_thread(
            self.receiver.expect, prefill.address, transfer_id, reservation.blocks_to_fill,
            reservation.num_cached_tokens, self.layout, self._writer(reservation),
        ))
        try:
            try:
                target = await asyncio.shield(expecting)
            except TransferError as exc:
                raise WorkerError(Failure.UNAVAILABLE, f"the KV receiver cannot take it: {exc}") from exc
            progress.enter(DecodeStage.PREFILLING, time.perf_counter())
            try:
                reply = await prefill.prefill(request_id, prompt_token_ids, params, target, _left(deadline), resumed,
                                              reservation.budget, reservation.adapter_fingerprint)
                progress.enter(DecodeStage.TRANSFERRING, time.perf_counter())
                progress.prefill = reply.figures
                await self._wait_for_kv(self.receiver.completion(transfer_id), deadline, prefill.address)
                if reservation.budget is not None and reply.kept is None:
                    # A worker that ignored the budget: its pages could not all have landed anyway.
                    raise WorkerError(Failure.UNAVAILABLE, f"prefill worker {prefill.address} named no kept blocks "
                                      "for kv_budget (a worker too old to serve budgets?)")
            except WorkerError as error:
                raise error.blaming(prefill.address) from error
            progress.enter(DecodeStage.JOINING, time.perf_counter())
            queue = self.loop.open_stream(request_id)
            try:
                output = await self.loop.call(StartDecode(request_id, reply.first_token, reply.kept))
            except TimeoutError as exc:  # the engine's own deadline for the reservation passed first
                raise WorkerError(Failure.DEADLINE, f"the prompt's KV from {prefill.address} was not complete "
                                  f"within {self.kv_timeout:g} s").blaming(prefill.address) from exc
            except ValueError as exc:  # kept blocks that do not fit the reservation: the prefill worker's fault
                raise WorkerError(Failure.UNAVAILABLE, f"prefill worker {prefill.address}: {exc}").blaming(
                    prefill.address) from exc
            self._waiting_for_kv -= 1
            progress.enter(DecodeStage.DECODING, time.perf_counter())
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
            progress.enter(DecodeStage.DONE, time.perf_counter())
        finally:
            self.loop.close_stream(request_id)
            if progress.stage.holds_reservation:
                self._waiting_for_kv -= 1
            if progress.stage is not DecodeStage.DONE:
                prefilling = progress.stage is DecodeStage.PREFILLING
                await asyncio.shield(self._abandon(request_id, transfer_id, expecting, prefill if prefilling else None))

    async def generate_local(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, progress: DecodeProgress,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request with its prompt (and a resumed request's delivered output) computed here,
        chunked beside the running batch (the gateway's conditional disaggregation, and every
        request of a colocated worker). Close it to abandon the request. Raises ValueError for bad input."""
        async for output in self.loop.generate(request_id, prompt_token_ids, params, resumed):
            if progress.stage is DecodeStage.RESERVING:
                progress.enter(DecodeStage.DECODING, time.perf_counter())
                # The prompt's prefix-cache hit here, which the worker's vllm:prefix_cache_hits counts.
                progress.local_cached_tokens = min(output.num_cached_tokens, len(prompt_token_ids))
            yield output
        progress.enter(DecodeStage.DONE, time.perf_counter())

    def _writer(self, reservation: KVReservation) -> WriteBlocks:
        loop = self.loop

        def write(layer: int, block_ids: Sequence[int], k, v) -> None:
            loop.import_pages(ImportPages(reservation, layer, block_ids, k, v))

        return write

    async def _wait_for_kv(self, completion: Future[int], deadline: float, peer: str) -> None:
        waiter = asyncio.wrap_future(completion)
        # The receiver's future must never be cancelled from here (it resolves it), so wait
        # without wait_for, and keep a late failure from being reported as never retrieved.
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({waiter}, timeout=_left(deadline))
        if not done:
            raise WorkerError(Failure.DEADLINE,
                              f"the prompt's KV from {peer} was not complete within {self.kv_timeout:g} s")
        try:
            waiter.result()
        except TransferError as exc:
            raise WorkerError(Failure.UNAVAILABLE, f"KV transfer from {peer} failed: {exc}") from exc

    async def _abandon(
        self, request_id: str, transfer_id: int, expecting: asyncio.Future, prefill: PrefillPeer | None
    ) -> None:
        if prefill is not None:
            prefill.abort(request_id)
        await asyncio.wait({expecting})
        if not expecting.cancelled():
            expecting.exception()  # retrieved: it failed the request already, if it failed
        # The transfer's state goes; a late page could not land in the blocks' next owner anyway
        # (engine.kv_connector.connector refuses writes into an ended reservation).
        await asyncio.to_thread(self.receiver.cancel, transfer_id)
        await self.loop.call(Abort(request_id))

    async def close(self, receiver: bool = True) -> None:
        """Stop the engine thread, then its senders and (unless a successor shares it) the receiver."""
        await super().close()
        if self.prefill_site is not None:
            await self.prefill_site.close()
        if receiver:
            await asyncio.to_thread(self.receiver.close)


def _reservation(result: ReserveResult) -> KVReservation:
    """The reservation, or WorkerError NO_ROOM when this worker cannot hold the prompt (now, or ever:
    another decode worker may have a bigger cache)."""
    if not isinstance(result, KVReservation):
        raise WorkerError(Failure.NO_ROOM, f"no KV room: {result}")
    return result


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
