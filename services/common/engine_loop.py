"""Runs an Engine on its own thread so that asyncio gRPC handlers never block on torch.

Every interaction with the engine is a message of `engine.commands`, queued and dispatched (in
`_dispatch`, the one place that knows the engine's methods) on the engine thread between steps,
so the engine needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc

from engine.commands import (
    Abort,
    AddAdapter,
    AddRequest,
    Command,
    GetStats,
    ImportPages,
    KeepAdapter,
    Release,
    RemoveAdapter,
    Reserve,
    StartDecode,
)
from engine.engine import Engine
from engine.outputs import RequestOutput, StepTokens
from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from engine.structured.grammars import GrammarsBusy
from services.common.errors import StatusError
from services.common.step_model import StepModelFit

log = logging.getLogger(__name__)

T = TypeVar("T")
_EMA = 0.2  # weight of the newest step in the moving averages below
_RANK_CHECK_S = 1.0  # how often an idle tensor-parallel engine's loop checks its other ranks


class StepRates:
    """Moving averages of measured prefill speed and decode step time, for load reports."""

    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0

    def record(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """Account one step that computed this many prompt and decode tokens."""
        if seconds <= 0:
            return
        if prefill_tokens > decode_tokens:
            rate = prefill_tokens / seconds
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else (
                (1 - _EMA) * self.prefill_tokens_per_s + _EMA * rate)
        elif decode_tokens:
            self.decode_step_s = seconds if not self.decode_step_s else (
                (1 - _EMA) * self.decode_step_s + _EMA * seconds)


class EngineLoop:
    """The engine thread plus the asyncio-facing API of one worker."""

    def __init__(self, engine: Engine, fit: StepModelFit | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        """`fit` is the step model to refine with every step (a new one if None). `on_fatal(reason)`
        runs once if the engine can never step again (a tensor-parallel rank is gone): the worker
        must stop serving."""
        self.engine = engine
        self._on_fatal = on_fatal
        self.rates = StepRates()
        spec = engine.config.speculative
        self.step_model = fit or StepModelFit(spec.disable_by_batch_size or 0 if spec is not None else 0)
        self._commands: deque[tuple[Command[Any], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._stopping = False
        self._step_observers: list[Callable[[StepTokens], None]] = []
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after the current step."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def observe_steps(self, observer: Callable[[StepTokens], None]) -> None:
        """Call `observer` with what each step computed, on the engine thread, after the step."""
        self._step_observers.append(observer)

    # ---- commands ---------------------------------------------------------------------------
    def submit(self, command: Command[T]) -> Future[T]:
        """Run a command on the engine thread between steps; a concurrent Future of its result."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine is stopping")
            self._commands.append((command, future))
            self._wake.notify()
        return future

    async def call(self, command: Command[T]) -> T:
        """Await a command run on the engine thread."""
        return await asyncio.wrap_future(self.submit(command))

    def import_pages(self, command: ImportPages) -> None:
        """Write received pages now, on the calling thread (see ImportPages for why that is safe)."""
        try:
            self._dispatch(command)
        except Exception:
            if self._lost_rank() is not None:  # the engine thread takes the worker down
                with self._wake:
                    self._wake.notify_all()
            raise

    async def compile_grammar(self, params: SamplingParams, timeout_s: float | None) -> None:
        """Compile a structured output's grammar before the request goes to the engine, on a thread
        of its own, so the engine's loop only copies it (the grammars are the one part of the
        engine a handler calls: thread-safe, and no engine state). ValueError naming the field if
        it does not compile or not within the limit (or `timeout_s`, the request's remaining
        deadline); RESOURCE_EXHAUSTED while every compile slot is taken."""
        if params.structured is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammars.compile, params.structured, timeout_s)
        except GrammarsBusy as error:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), retry_after_s=1.0) from None

    async def ready_adapter(self, params: SamplingParams) -> None:
        """Read a request's LoRA adapter back into memory before the request goes to the engine,
        where the engine dropped it (beyond --max-cpu-loras), on a thread of its own: the engine's
        loop would otherwise read its files in the middle of a step, stalling every running
        request, and files gone since it was served would fail that step and so every request in
        it. AdapterError (a ValueError) naming the adapter if it can no longer be served."""
        path = self.engine.needs_read(params.lora_name)
        if path is None:
            return
        adapter = await asyncio.to_thread(self.engine.read_adapter, params.lora_name, path)
        await self.call(KeepAdapter(adapter))

    # ---- streams ----------------------------------------------------------------------------
    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | Exception]:
        """Route this request's outputs to a queue on the calling event loop. Call it before the
        request is added, from the event loop that will read the queue. An Exception in the
        queue means the engine failed the request."""
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def close_stream(self, request_id: str) -> None:
        """Stop routing a request's outputs (after it finished or was aborted)."""
        self._streams.pop(request_id, None)

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        resumed: Resumed | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request (`resumed`: after output delivered elsewhere) and yield its outputs until it
        finishes. Raises ValueError for bad input. If the consumer stops early (cancelled, client
        gone), the request is aborted."""
        queue = self.open_stream(request_id)
        finished = False
        try:
            await self.call(AddRequest(request_id, prompt_token_ids, params, resumed))
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    finished = True
                    raise output
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self.close_stream(request_id)
            if not finished:
                self.submit(Abort(request_id))

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        # A tensor- or context-parallel rank may die while the worker is idle, or while pages are
        # imported on a receiver's thread: look now and then, not only when a step fails.
        watch = _RANK_CHECK_S if engine.config.world_size > 1 else None
        while True:
            lost = None
            with self._wake:
                while not (self._stopping or self._commands or engine.has_unfinished()):
                    if (lost := self._lost_rank()) is not None:
                        break
                    self._wake.wait(_until(engine.next_kv_deadline(), watch))
                if self._stopping:
                    self._fail_pending()
                    return
                commands = list(self._commands)
                self._commands.clear()
            if lost is not None:
                self._fail(RuntimeError(lost), "a tensor-parallel rank is gone")
                continue
            for command, future in commands:
                self._execute(command, future)
            if engine.has_unfinished():
                self._step()

    def _execute(self, command: Command[Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self._dispatch(command))
        except BaseException as exc:  # handed to the awaiting caller, whatever it is
            future.set_exception(exc)
            # Moving pages between tensor-parallel ranks fails when one is gone: nothing can run then.
            if self._lost_rank() is not None:
                self._fail(exc, "engine command failed with a tensor-parallel rank gone")

    def _dispatch(self, command: Command[Any]) -> object:
        engine = self.engine
        match command:
            case AddRequest(request_id, prompt, params, resumed, export):
                return engine.add_request(request_id, prompt, params, resumed, export)
            case Reserve(request_id, prompt, params, resumed, kv_timeout_s):
                return engine.reserve(request_id, prompt, params, resumed, kv_timeout_s)
            case ImportPages(reservation, layer, block_ids, k, v):
                return engine.import_kv(reservation, layer, block_ids, k, v)
            case StartDecode(request_id, first_token, kept):
                return engine.start_decode(request_id, first_token, kept)
            case Release(request_id):
                return engine.release(request_id)
            case Abort(request_id):
                return engine.abort(request_id)
            case GetStats():
                return engine.stats()
            case AddAdapter(adapter):
                return engine.add_adapter(adapter)
            case KeepAdapter(adapter):
                return engine.keep_adapter(adapter)
            case RemoveAdapter(name):
                return engine.remove_adapter(name)
        raise TypeError(f"not an engine command: {command!r}")

    def _step(self) -> None:
        engine = self.engine
        started = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as exc:
            self._fail(exc, "engine step failed")
            return
        tokens = engine.last_step_tokens
        seconds = time.perf_counter() - started
        self.rates.record(tokens.prefill, tokens.decode, seconds)
        self.step_model.record(tokens.prefill, tokens.decode, tokens.decode_context, seconds)
        self.step_model.record_speculation(tokens.decode, tokens.draft, tokens.decode_tokens)
        for observer in self._step_observers:
            observer(tokens)
        for output in outputs:
            self._deliver(output.request_id, output)

    def _lost_rank(self) -> str | None:
        """Which other rank of a tensor- or context-parallel engine is gone, if one is (never at size 1)."""
        return self.engine.lost_rank() if self.engine.config.world_size > 1 else None

    def _fail(self, exc: BaseException, what: str) -> None:
        """A step (or a command) failed: no request may be stranded, so abort them all and tell
        their readers; with a tensor-parallel rank gone the engine can never step again, so stop."""
        engine = self.engine
        log.exception("%s; aborting every request the engine held", what, exc_info=exc)
        for request_id in list(engine.scheduler.requests):
            engine.abort(request_id)
        for request_id in list(self._streams):
            self._deliver(request_id, RuntimeError(f"{what}: {exc}"))
        lost = self._lost_rank()
        if lost is not None:
            log.critical("the engine cannot step again: %s", lost)
            with self._wake:
                self._stopping = True
            if self._on_fatal is not None:
                self._on_fatal(lost)

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_pending(self) -> None:
        for _, future in self._commands:
            future.cancel()
        self._commands.clear()


def _until(deadline: float | None, watch: float | None) -> float | None:
    """How long an idle loop may wait: until the engine's next KV deadline (a step then frees what
    it held), or `watch`, whichever comes first (None: no limit)."""
    if deadline is None:
        return watch
    left = max(0.0, deadline - time.monotonic())
    return left if watch is None else min(left, watch)
