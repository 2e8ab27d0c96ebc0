"""The engines one decode (or colocated) worker process serves: the version new requests get, and
the versions a hot swap in the process retired (services.decode.model_swap), which finish their
requests and take the ones routed to them before the gateway heard of the swap, until unloaded."""

from __future__ import annotations

import asyncio

from kvtransfer.grpc_stream import KVTransferServicer
from services.common.failure import Failure, WorkerError
from services.common.startup_profile import profile_engine
from services.common.worker import RoleWorker
from services.common.worker_metrics import WorkerMetrics
from services.common.worker_rpcs import WorkerRpcs
from services.decode.telemetry import NO_KV_ROOM, OBJECTIVES
from services.decode.worker import DecodeWorker


class ServedEngines:
    """Which DecodeWorker (one per loaded model version) the servicer's RPCs reach, and those of
    `others` (a colocated worker's Prefill service); the KV service accepts the layouts of all of them."""

    def __init__(self, rpcs: WorkerRpcs[DecodeWorker], metrics: WorkerMetrics,
                 others: tuple[WorkerRpcs[RoleWorker], ...] = ()) -> None:
        self._rpcs = rpcs
        self._others = others
        self._metrics = metrics
        self.kv_transfer: KVTransferServicer | None = None  # set with the first worker

    @property
    def current(self) -> DecodeWorker | None:
        """The worker new requests for this process's version go to (None while loading)."""
        return self._rpcs.worker

    @property
    def retiring(self) -> tuple[DecodeWorker, ...]:
        """Workers of versions a swap replaced, still loaded."""
        return self._rpcs.retiring

    def find(self, version_key: str) -> DecodeWorker | None:
        """The loaded worker serving NAME@VERSION, if any."""
        workers = (*([self.current] if self.current is not None else []), *self.retiring)
        return next((worker for worker in workers if worker.version_key == version_key), None)

    def serving(self, requested: str) -> DecodeWorker:
        """The worker for a request routed for `requested` (NAME@VERSION; "": this process's version).
        WorkerError UNAVAILABLE when no loaded version is it, so that the gateway tries another worker."""
        current = self.current
        assert current is not None  # the servicer answers UNAVAILABLE until the first worker is in
        if not requested or requested == current.version_key:
            return current
        worker = self.find(requested)
        if worker is None:
            raise WorkerError(Failure.UNAVAILABLE, f"this worker serves {current.version_key}, not {requested}")
        return worker

    async def start(self, worker: DecodeWorker) -> None:
        """Profile the worker's engine (its step model), start its thread and export its load; it
        takes no request before `promote`."""
        await asyncio.to_thread(profile_engine, worker.loop.engine, worker.loop.step_model)
        worker.loop.start()
        self._metrics.watch_engine(worker.loop, lambda: worker.reserved_requests)
        config = worker.loop.engine.config
        self._metrics.labelled(config.served_name, config.model_version).count_outcomes(OBJECTIVES, (NO_KV_ROOM,))

    def promote(self, worker: DecodeWorker) -> None:
        """Send new requests to `worker`; the one serving until now retires beside it."""
        previous = self._rpcs.worker
        retiring = [w for w in self._rpcs.retiring if w is not worker]
        if previous is not None and previous is not worker:
            retiring.insert(0, previous)
        self._rpcs.retiring = tuple(retiring)
        self._rpcs.worker = worker
        self._mirror()
        if self.kv_transfer is not None:
            self.kv_transfer.layouts = (worker.layout, *(w.layout for w in retiring))

    async def unload(self, worker: DecodeWorker) -> None:
        """Stop and drop a retiring worker's engine (its requests have finished)."""
        self._rpcs.retiring = tuple(w for w in self._rpcs.retiring if w is not worker)
        self._mirror()
        if self.kv_transfer is not None:
            self.kv_transfer.layouts = tuple(w.layout for w in (self.current, *self.retiring) if w is not None)
        self._metrics.unwatch(worker.loop)
        await worker.close(receiver=False)

    def _mirror(self) -> None:
        for rpcs in self._others:
            rpcs.worker, rpcs.retiring = self._rpcs.worker, self._rpcs.retiring

    async def close(self) -> None:
        """Stop every engine, then the KV receiver they share."""
        for worker in self.retiring:
            await worker.close(receiver=False)
        if self.current is not None:
            await self.current.close()
