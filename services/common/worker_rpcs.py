"""The Abort, GetLoad and WatchLoad RPCs, served the same way by every worker service."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Generic, TypeVar

import grpc
from tandem.v1 import common_pb2

from services.common.convert import load_report
from services.common.worker import RoleWorker

_DEFAULT_WATCH_INTERVAL_MS = 200

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

    async def report(self, worker: W) -> common_pb2.LoadReport:
        """`worker`'s load report, naming the versions still retiring beside it."""
        return load_report(await worker.load(tuple(w.version_key for w in self.retiring)))

    async def WatchLoad(self, request: common_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext) -> None:
        """Write a report every interval until the client goes away (which cancels this) or the
        server drains (so that watchers do not hold the drain). Each report is of the worker serving
        then (a hot swap replaces it)."""
        worker = await self.ready(context)
        interval = (request.interval_ms or _DEFAULT_WATCH_INTERVAL_MS) / 1000
        while not worker.draining.is_set():
            worker = self.worker or worker
            await context.write(await self.report(worker))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.draining.wait(), interval)
