"""The prefill role: compute a prompt, push its KV pages layer by layer, return the first token.

Transport-free: failures are WorkerErrors (and ValueError for bad input), which the handler maps
to gRPC statuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.commands import Abort, AddRequest, Release
from engine.engine import Engine
from engine.kv_connector.export import KVExport
from engine.outputs import RequestOutput
from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import LayoutTransferError, TransferError, TransferTarget
from kvtransfer.sender import KVSenderPool
from kvtransfer.transport import KVSender
from services.common.engine_loop import EngineLoop
from services.common.failure import Failure, WorkerError
from services.common.worker import RoleWorker
from services.prefill.kv_push import KVPush


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


class PrefillWorker(RoleWorker):
    """A prefill engine that pushes every request's pages to its decode worker, layer by layer."""

    def __init__(
        self,
        address: str,
        engine: Engine,
        draining: asyncio.Event,
        senders: KVSenderPool,
        transfer_timeout: float,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """`senders`: the connections to decode workers' KV receivers (they check the layout when they
        pair). `on_fatal(reason)`: the engine can never step again (services.common.engine_loop)."""
        super().__init__("prefill", address, EngineLoop(engine, on_fatal=on_fatal), draining)
        self.senders = senders
        self.transfer_timeout = transfer_timeout
        self._delivery_wait_s = 0.0

    @property
    def kv_delivery_wait_s(self) -> float:
        return self._delivery_wait_s

    async def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, target: TransferTarget,
        resumed: Resumed | None = None,
    ) -> PrefillResult:
        """Prefill one prompt into `target` (with `resumed`: the prompt and the output already
        delivered, then the next token); returns once the pages were delivered.

        Raises ValueError for bad input, WorkerError MISMATCH if the target's layout differs from
        ours, UNAVAILABLE if the pages cannot be delivered. Whatever happens (including
        cancellation), the request's blocks are freed before this returns.
        """
        sender = await self._sender(target)
        queue = self.loop.open_stream(request_id)
        added_at = time.perf_counter()
        push = KVPush(request_id, sender)
        released = False
        try:
            export = KVExport(push, receiver_cached_tokens=target.num_cached_tokens)
            await self.loop.call(AddRequest(request_id, prompt_token_ids, params, resumed, export))
            output = await queue.get()
            if isinstance(output, Exception):
                raise output
            done_at = time.perf_counter()
            kv_bytes = await self._deliver(push)
            delivered_at = time.perf_counter()
            wait = delivered_at - done_at
            self._delivery_wait_s = wait if not self._delivery_wait_s else 0.8 * self._delivery_wait_s + 0.2 * wait
            await self.loop.call(Release(request_id))
            released = True
        finally:
            self.loop.close_stream(request_id)
            if not released:
                # Once the engine dropped the request it hands the push no page: abort the sender then.
                self.loop.submit(Abort(request_id)).add_done_callback(lambda _: sender.abort())
        started_at = push.started_at if push.started_at is not None else added_at
        return PrefillResult(output, kv_bytes, target.backend, added_at, started_at, done_at, delivered_at,
                             tuple(push.layers))

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
        """Stop the engine thread, then drop the connections to decode workers."""
        await super().close()
        await asyncio.to_thread(self.senders.close)


def _abort_sender(pairing: asyncio.Future[KVSender]) -> None:
    if not pairing.cancelled() and pairing.exception() is None:
        pairing.result().abort()
