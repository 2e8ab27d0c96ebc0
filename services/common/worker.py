"""What the prefill and decode workers share: the engine thread, the requests in flight, the load
report, and the Abort / GetLoad / WatchLoad RPCs that every worker service serves the same way."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Generic, TypeVar

import grpc
from tandem.v1 import common_pb2

from services.common.convert import load_report
from services.common.engine_loop import EngineLoop
from services.common.inflight import InflightRequests

_DEFAULT_WATCH_INTERVAL_MS = 200


class Worker:
    """One loaded engine serving one role, as its gRPC handlers see it."""

    def __init__(self, role: str, address: str, loop: EngineLoop, draining: asyncio.Event) -> None:
        self.role = role
        self.worker_id = f"{role}@{address}"
        self.loop = loop
        self.draining = draining
        self.inflight = InflightRequests()

    @property
    def reserved_requests(self) -> int:
        """Requests whose KV is reserved here and still arriving (only the decode role has any)."""
        return 0

    @property
    def kv_delivery_wait_s(self) -> float:
        """Recent wait for KV delivery after a first token (only the prefill role has one)."""
        return 0.0

    async def load_report(self) -> common_pb2.LoadReport:
        """This worker's load now (the engine's stats are read on its thread, between steps)."""
        stats, block_size, budget = await self.loop.call(
            lambda e: (e.stats(), e.kv.block_size, e.config.scheduler.max_num_batched_tokens))
        return load_report(
            stats,
            self.loop.rates,
            worker_id=self.worker_id,
            role=self.role,
            block_size=block_size,
            reserved_requests=self.reserved_requests,
            finished_requests=self.inflight.finished,
            step_model=self.loop.step_model.model,
            max_num_batched_tokens=budget,
            kv_delivery_wait_s=self.kv_delivery_wait_s,
        )

    async def watch_load(self, interval_ms: int, context: grpc.aio.ServicerContext) -> None:
        """Write a report every interval until the client goes away (which cancels this) or the
        server drains (so that watchers do not hold the drain)."""
        interval = (interval_ms or _DEFAULT_WATCH_INTERVAL_MS) / 1000
        while not self.draining.is_set():
            await context.write(await self.load_report())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.draining.wait(), interval)

    async def close(self) -> None:
        """Stop the engine thread (after the server drained)."""
        await asyncio.to_thread(self.loop.stop)


W = TypeVar("W", bound=Worker)


class WorkerRpcs(Generic[W]):
    """Abort, GetLoad and WatchLoad for a worker service; mixed into the role's servicer.

    `worker` is None until the model is loaded; until then every RPC answers UNAVAILABLE.
    """

    worker: W | None = None

    async def ready(self, context: grpc.aio.ServicerContext) -> W:
        """The loaded worker, or end the RPC with UNAVAILABLE."""
        if self.worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.worker is not None  # context.abort raised otherwise
        return self.worker

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        worker = await self.ready(context)
        return common_pb2.AbortResponse(found=worker.inflight.abort(request.request_id))

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        worker = await self.ready(context)
        return await worker.load_report()

    async def WatchLoad(self, request: common_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext) -> None:
        worker = await self.ready(context)
        await worker.watch_load(request.interval_ms, context)
