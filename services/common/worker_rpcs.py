"""The Abort, GetLoad and WatchLoad RPCs, served the same way by every worker service."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Generic, TypeVar

import grpc
from tandem.v1 import common_pb2

from engine.kv_cache.kv_events import EventBatch
from services.common.convert import load_report
from services.common.worker import RoleWorker

_DEFAULT_WATCH_INTERVAL_MS = 200
# Block events waiting send a report before the interval ends, at most this often: the gateway routes
# a conversation's next turn by them, which may come as soon as the previous turn's reply ended.
_EVENTS_POLL_S = 0.05

W = TypeVar("W", bound=RoleWorker)
T = TypeVar("T")


async def loaded(value: T | None, context: grpc.aio.ServicerContext) -> T:
    """`value`, set once the model is loaded; until then end the RPC with UNAVAILABLE."""
    if value is None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
    assert value is not None  # context.abort raised otherwise
    return value


class WorkerRpcs(Generic[W]):
    """Abort, GetLoad and WatchLoad for a worker service; mixed into the role's servicer.

    `worker` is None until the model is loaded; until then every RPC answers UNAVAILABLE. `retiring`
    are the workers of the versions a hot swap replaced (services.decode.model_swap) while they finish
    their requests: Abort finds requests there too, and load reports name their versions.
    """

    worker: W | None = None
    retiring: tuple[W, ...] = ()

    async def ready(self, context: grpc.aio.ServicerContext) -> W:
        """The loaded worker, or end the RPC with UNAVAILABLE."""
        return await loaded(self.worker, context)

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        worker = await self.ready(context)
        found = [w.inflight.abort(request.request_id) for w in (worker, *self.retiring)]
        return common_pb2.AbortResponse(found=any(found))

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        worker = await self.ready(context)
        return await self.report(worker)

    async def report(self, worker: W, events: EventBatch | None = None) -> common_pb2.LoadReport:
        """`worker`'s load report, naming the versions still retiring beside it, with block `events`."""
        return load_report(await worker.load(tuple(w.version_key for w in self.retiring)), events)

    async def WatchLoad(self, request: common_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext) -> None:
        """Write a report every interval, or sooner once block events wait, until the client goes
        away (which cancels this) or the server drains (so that watchers do not hold the drain). Each
        report is of the worker serving then (a hot swap replaces it) and carries the block events
        since this stream's previous one: a snapshot first, and again when the stream fell behind
        the engine's event log or the worker was replaced (its engine's log is another)."""
        worker = await self.ready(context)
        interval = (request.interval_ms or _DEFAULT_WATCH_INTERVAL_MS) / 1000
        events, cursor = worker.kv_events, None
        while not worker.draining.is_set():
            worker = self.worker or worker
            if worker.kv_events is not events:
                events, cursor = worker.kv_events, None
            batch = events.read(cursor)
            cursor = batch.cursor
            await context.write(await self.report(worker, batch))
            await _until_due(worker, interval, cursor)


async def _until_due(worker: RoleWorker, interval: float, cursor: int) -> None:
    """Wait until the next report is due: `interval` passed, block events past `cursor` wait (checked
    every _EVENTS_POLL_S), or the worker drains."""
    waited = 0.0
    while waited < interval and not worker.draining.is_set():
        step = min(_EVENTS_POLL_S, interval - waited)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(worker.draining.wait(), step)
        waited += step
        if worker.kv_events.next_seq != cursor:
            return
