"""Computing a prompt for another worker: the prompt runs in this worker's engine with its pages
pushed layer by layer to the decode site's KV receiver, and the first token goes back. Prefill
workers do only this; colocated workers do it beside their own requests (the engine hands off a
request added with an export, engine.kv_connector).

Transport-free: failures are WorkerErrors (and ValueError for bad input), which the Prefill
service maps to gRPC statuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.commands import Abort, AddRequest, Release
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.kv_connector.export import KVExport
from engine.outputs import RequestOutput
from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import KVLayout, LayoutTransferError, TransferError, TransferTarget
from kvtransfer.sender import KVSenderPool
from kvtransfer.transport import KVSender
from services.common.engine_loop import EngineLoop
from services.common.failure import Failure, WorkerError
from services.common.kv_push import KVPush
from services.common.worker_config import WorkerConfig


@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill: the first token's output, the bytes pushed, and when each stage ended
    (perf_counter seconds)."""

    output: RequestOutput
    kv_bytes: int
    backend: str
    added_at: float
    started_at: float  # the request's first layer computed: its queue wait is over
    done_at: float  # the first token sampled
    delivered_at: float  # the receiver has every page
    layers: tuple[tuple[int, float, int], ...]  # (layer, time handed to the sender, bytes)
    kept: KeptBlocks | None = None  # under the receiver's KV budget: the blocks pushed

    @property
    def queue_s(self) -> float:
        """Waiting in the engine's queue."""
        return self.started_at - self.added_at

    @property
    def compute_s(self) -> float:
        """The prompt's forward passes, until the first token."""
        return self.done_at - self.started_at

    @property
    def transfer_s(self) -> float:
        """From the first layer's pages leaving until the receiver had every page."""
        return self.delivered_at - self.started_at

    @property
    def delivery_wait_s(self) -> float:
        """After the first token, until the receiver held every page: the transfer compute did not hide."""
        return self.delivered_at - self.done_at


def sender_pool(config: WorkerConfig, layout: KVLayout) -> KVSenderPool:
    """The connections a worker of `config` pushes pages over to decode sites' KV receivers (they
    check the layout when they pair)."""
    return KVSenderPool(layout, timeout=config.kv_timeout, device=config.served_engine.device,
                        connect=config.channels.open_sync, host=config.advertise_host, checksum=config.kv_checksum)


class PrefillSite:
    """One engine loop computing prompts for decode sites, pushing every request's pages as its
    layers write them."""

    def __init__(self, loop: EngineLoop, senders: KVSenderPool, transfer_timeout: float) -> None:
        self.loop = loop
        self.senders = senders
        self.transfer_timeout = transfer_timeout
        self.delivery_wait_s = 0.0  # recent wait for delivery after a first token (a moving average)

    async def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, target: TransferTarget,
        resumed: Resumed | None = None, budget: KVBudget | None = None, adapter_fingerprint: bytes = b"",
    ) -> PrefillResult:
        """Prefill one prompt into `target` (with `resumed`: the prompt and the output already
        delivered, then the next token); returns once the pages were delivered. Under the
        receiver's `budget` only the blocks the prompt keeps go (engine.kv_connector.export says
        when; their indices are in the result): the target's blocks are just as many. The prompt
        is computed only under the LoRA adapter the receiver runs it under (`adapter_fingerprint`,
        b"" for the base): AdapterMismatch naming it (nothing computed) where this engine's differs.

        Raises ValueError for bad input (a budget this engine cannot score for included),
        WorkerError MISMATCH if the target's layout differs from ours, NO_ROOM at once if a worker
        that decodes too has no blocks for it now, UNAVAILABLE if the pages cannot be delivered.
        Whatever happens (including cancellation), the request's blocks are freed before this returns.
        """
        if budget is not None:
            _check_kept_room(target, budget, len(prompt_token_ids) + (len(resumed.output_token_ids) if resumed else 0))
        sender = await self._sender(target)
        queue = self.loop.open_stream(request_id)
        added_at = time.perf_counter()
        push = KVPush(request_id, sender)
        released = False
        try:
            export = KVExport(push, target.num_cached_tokens, budget, adapter_fingerprint)
            refused = await self.loop.call(AddRequest(request_id, prompt_token_ids, params, resumed, export))
            if refused is not None:
                # The decode site's reservation must not wait for blocks this worker's own reservations hold.
                raise WorkerError(Failure.NO_ROOM, f"no KV room to compute the prompt now: {refused}")
            output = await queue.get()
            if isinstance(output, Exception):
                raise output
            done_at = time.perf_counter()
            kv_bytes = await self._deliver(push)
            delivered_at = time.perf_counter()
            wait = delivered_at - done_at
            self.delivery_wait_s = wait if not self.delivery_wait_s else 0.8 * self.delivery_wait_s + 0.2 * wait
            await self.loop.call(Release(request_id))
            released = True
        finally:
            self.loop.close_stream(request_id)
            if not released:
                # Once the engine dropped the request it hands the push no page: abort the sender then.
                self.loop.submit(Abort(request_id)).add_done_callback(lambda _: sender.abort())
        started_at = push.started_at if push.started_at is not None else added_at
        return PrefillResult(output, kv_bytes, target.backend, added_at, started_at, done_at, delivered_at,
                             tuple(push.layers), push.kept_blocks)

    async def _sender(self, target: TransferTarget) -> KVSender:
        """A sender for the target, paired off the event loop; WorkerError MISMATCH if pairing finds the
        layouts differ, UNAVAILABLE if the receiver is unreachable."""
        pairing = asyncio.ensure_future(asyncio.to_thread(self.senders.sender, target))
        try:
            return await asyncio.shield(pairing)
        except asyncio.CancelledError:
            # Pairing goes on in its thread; a sender it yields after the request was given up is aborted.
            pairing.add_done_callback(_abort_sender)
            raise
        except LayoutTransferError as exc:
            raise WorkerError(Failure.MISMATCH, f"KV layout mismatch: {exc.reason}") from exc
        except TransferError as exc:
            raise WorkerError(Failure.UNAVAILABLE, f"cannot reach the KV receiver: {exc}") from exc

    async def _deliver(self, push: KVPush) -> int:
        """Send the end marker and wait (off the event loop) until the receiver has every page."""
        if push.error is not None:
            raise WorkerError(Failure.UNAVAILABLE, f"KV push failed: {push.error}")
        push.sender.finish()
        try:
            return await asyncio.to_thread(push.sender.wait, self.transfer_timeout)
        except TransferError as exc:
            raise WorkerError(Failure.UNAVAILABLE, f"KV transfer failed: {exc}") from exc

    async def close(self) -> None:
        """Drop the connections to decode sites (after the engine thread stopped)."""
        await asyncio.to_thread(self.senders.close)


def _check_kept_room(target: TransferTarget, budget: KVBudget, num_tokens: int) -> None:
    """ValueError naming the field unless the target reserved a block for each block a prompt of
    `num_tokens` tokens keeps under `budget`."""
    num_blocks = blocks_for(num_tokens, budget.block_size)
    kept = budget.kept_count(num_blocks, num_tokens)
    if len(target.block_ids) != kept:
        raise ValueError(f"kv_target.block_ids: {len(target.block_ids)} blocks, but the prompt keeps {kept} of its "
                         f"{num_blocks} under kv_budget")


def _abort_sender(pairing: asyncio.Future[KVSender]) -> None:
    if not pairing.cancelled() and pairing.exception() is None:
        pairing.result().abort()
