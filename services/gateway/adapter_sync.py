"""The model repository's LoRA adapters, kept loaded on every worker of their base version.

Each pass (once a second, and as soon as it starts) compares what the repository declares
(`[[model.version.adapter]]`, services.repository.config) with what each routable worker of the
base reports serving, loads an adapter where it is missing (a worker that started or restarted, a
new entry in the file) and unloads one whose entry left the file. The gateway does this rather
than each worker, so an adapter added to the file is served without restarting a worker, as a new
version's split is (services.gateway.repository_watch). A worker that refuses an adapter is
logged and asked again only after `retry_s`: a refusal names a fault in the file or the adapter
that asking again will not cure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common.errors import StatusError
from services.gateway.catalog import ModelCatalog
from services.gateway.registry import WorkerRegistry
from services.gateway.workers import RemoteWorker

log = logging.getLogger(__name__)


class AdapterSync:
    """Brings `registry`'s workers to the adapters of the repository that `catalog()` serves
    (None while it loads)."""

    def __init__(self, registry: WorkerRegistry, catalog: Callable[[], ModelCatalog | None],
                 interval_s: float = 1.0, retry_s: float = 30.0, timeout_s: float = 60.0) -> None:
        self._registry = registry
        self._catalog = catalog
        self._interval_s = interval_s
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._declared: set[str] = set()  # every adapter name the repository declared since start
        self._busy: set[tuple[str, str]] = set()  # (worker, adapter) with a call in flight
        self._failed: dict[tuple[str, str], float] = {}  # (worker, adapter) -> when to ask again
        self._task: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()

    def start(self) -> None:
        """Run passes on the running event loop."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop passing, and the calls in flight."""
        tasks = [task for task in (self._task, *self._calls) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def sync(self) -> None:
        """One pass: start the loads and unloads the workers need now."""
        catalog = self._catalog()
        if catalog is None or catalog.repository is None:
            return
        wanted = {adapter.name: (base, adapter.path) for base, adapter in catalog.repository.adapters}
        self._declared |= wanted.keys()
        now = time.monotonic()
        for worker in self._registry.workers:
            if not worker.routable:
                continue
            served = {adapter.name for adapter in worker.adapters}
            for name, (base, path) in wanted.items():
                if base == worker.version_key and name not in served and self._due(worker, name, now):
                    self._call(worker, name, "load", worker.load_adapter(name, path, self._timeout_s))
            for name in served & (self._declared - wanted.keys()):
                if self._due(worker, name, now):
                    self._call(worker, name, "unload", worker.unload_adapter(name, self._timeout_s))

    def _due(self, worker: RemoteWorker, name: str, now: float) -> bool:
        key = (worker.address, name)
        return key not in self._busy and self._failed.get(key, 0.0) <= now

    def _call(self, worker: RemoteWorker, name: str, change: str, call: Awaitable[object]) -> None:
        key = (worker.address, name)
        self._busy.add(key)

        async def run() -> None:
            try:
                await call
                self._failed.pop(key, None)
                log.info("model repository: LoRA adapter %s: %s on worker %s", name, change + "ed", worker.address)
            except StatusError as error:
                if change == "unload" and error.code == grpc.StatusCode.NOT_FOUND:
                    return
                self._failed[key] = time.monotonic() + self._retry_s
                log.error("model repository: LoRA adapter %s: worker %s refused to %s it (%s: %s); asking again "
                          "in %.0f s", name, worker.address, change, error.code.name, error.message, self._retry_s)
            finally:
                self._busy.discard(key)

        task = asyncio.create_task(run())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run(self) -> None:
        while True:
            self.sync()
            await asyncio.sleep(self._interval_s)
