"""The prefill role: compute a prompt, push its KV pages layer by layer, return the first token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import KVLayout, LayoutTransferError, TransferError, TransferTarget
from kvtransfer.sender import KVSender, KVSenderPool
from services.common.engine_loop import EngineLoop
from services.common.errors import StatusError
from services.common.worker import Worker
from services.prefill.kv_push import KVPush, KVPushHook


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


class PrefillWorker(Worker):
    """A prefill engine whose layer hook pushes every request's pages to its decode worker."""

    def __init__(
        self,
        address: str,
        engine: Engine,
        draining: asyncio.Event,
        layout: KVLayout,
        transfer_timeout: float,
        connect: Callable[[str], grpc.Channel] = grpc.insecure_channel,
    ) -> None:
        """`connect` opens the channel to a decode worker's gRPC KV receiver (TLS or not)."""
        self.hook = KVPushHook(engine)
        super().__init__("prefill", address, EngineLoop(engine, layer_hook=self.hook), draining)
        self.senders = KVSenderPool(layout, timeout=transfer_timeout, device=engine.config.device, connect=connect)
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

        Raises ValueError for bad input, StatusError FAILED_PRECONDITION if the target's layout
        differs from ours, UNAVAILABLE if the pages cannot be delivered. Whatever happens
        (including cancellation), the request's blocks are freed before this returns.
        """
        sender = await self._sender(target)
        queue = self.loop.open_stream(request_id)
        added_at = time.perf_counter()
        released = False
        try:
            push = await self.loop.call(
                lambda e: self._add(e, request_id, prompt_token_ids, params, resumed, sender, target.num_cached_tokens)
            )
            output = await queue.get()
            if isinstance(output, Exception):
                raise output
            done_at = time.perf_counter()
            kv_bytes = await self._deliver(push)
            delivered_at = time.perf_counter()
            wait = delivered_at - done_at
            self._delivery_wait_s = wait if not self._delivery_wait_s else 0.8 * self._delivery_wait_s + 0.2 * wait
            await self.loop.call(lambda e: self._release(e, request_id))
            released = True
        finally:
            self.loop.close_stream(request_id)
            if not released:
                self.loop.submit(lambda e: self._abort(e, request_id, sender))
        started_at = push.started_at if push.started_at is not None else added_at
        return PrefillResult(output, kv_bytes, target.backend, added_at, started_at, done_at, delivered_at,
                             tuple(push.layers))

    async def _sender(self, target: TransferTarget) -> KVSender:
        """A sender for the target, paired off the event loop; StatusError FAILED_PRECONDITION if
        pairing finds the layouts differ, UNAVAILABLE if the receiver is unreachable."""
        pairing = asyncio.ensure_future(asyncio.to_thread(self.senders.sender, target))
        try:
            return await asyncio.shield(pairing)
        except asyncio.CancelledError:
            # Pairing goes on in its thread; a sender it yields after the request was given up is aborted.
            pairing.add_done_callback(_abort_sender)
            raise
        except LayoutTransferError as exc:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout mismatch: {exc.reason}") from exc
        except TransferError as exc:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"cannot reach the KV receiver: {exc}") from exc

    async def _deliver(self, push: KVPush) -> int:
        """Send the end marker and wait (off the event loop) until the receiver has every page."""
        if push.error is not None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {push.error}")
        push.sender.finish()
        try:
            return await asyncio.to_thread(push.sender.wait, self.transfer_timeout)
        except TransferError as exc:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {exc}") from exc

    async def close(self) -> None:
        """Stop the engine thread, then drop the connections to decode workers."""
        await super().close()
        await asyncio.to_thread(self.senders.close)

    # ---- on the engine thread ---------------------------------------------------------------
    def _add(
        self,
        engine: Engine,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resumed: Resumed | None,
        sender: KVSender,
        num_cached_tokens: int,
    ) -> KVPush:
        # Registered before the request can be scheduled, so the hook sees its very first layer.
        push = self.hook.register(request_id, sender, num_cached_tokens)
        try:
            engine.add_request(request_id, prompt_token_ids, params, resumed)
        except BaseException:
            self.hook.unregister(request_id)
            raise
        return push

    def _release(self, engine: Engine, request_id: str) -> None:
        self.hook.unregister(request_id)
        engine.release(request_id)

    def _abort(self, engine: Engine, request_id: str, sender: KVSender) -> None:
        # Unregistered first, on this thread: the hook cannot send for the request after this.
        self.hook.unregister(request_id)
        engine.abort(request_id)
        sender.abort()


def _abort_sender(pairing: asyncio.Future[KVSender]) -> None:
    if not pairing.cancelled() and pairing.exception() is None:
        pairing.result().abort()
