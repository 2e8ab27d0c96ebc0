"""Loading and unloading a LoRA adapter on every worker of its base version, all or none.

The gateway asks each routable worker of the base (every role: a prompt and its decode both run
under the adapter) through its LoraAdapters service at once. A load some worker refuses is undone
on the workers that took it, and an unload some worker refuses is undone by loading the adapter
again (from the directory it reported) where it was removed: the served set is left as it was, so
requests never find the adapter on some of its base's workers and not on others. One change runs at
a time. The answer comes once every changed worker's load reports show the change, so a request
sent after it is routed by it.

A worker that is not routable when the change is made does not get it; nor does one that joins later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common.errors import StatusError
from services.gateway.adapter_watch import AdapterWatch
from services.gateway.adapters import AdapterRef
from services.gateway.catalog import ModelCatalog
from services.gateway.registry import WorkerRegistry
from services.gateway.workers import RemoteWorker

log = logging.getLogger(__name__)

# A worker's refusals that the adapter or the request is at fault for (HTTP 400); any other failure
# is the worker's state now (503).
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.ALREADY_EXISTS)
_SETTLE_POLL_S = 0.05


class AdapterAdmin:
    """Changes to the adapters `registry`'s workers serve, over the table `adapters` keeps and the
    models `catalog()` serves; each worker's call may take `timeout_s` (reading an adapter), and
    the load reports `settle_s` to show the change."""

    def __init__(self, registry: WorkerRegistry, adapters: AdapterWatch, catalog: Callable[[], ModelCatalog],
                 timeout_s: float = 60.0, settle_s: float = 5.0) -> None:
        self._registry = registry
        self._adapters = adapters
        self._catalog = catalog
        self._timeout_s = timeout_s
        self._settle_s = settle_s
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str, base: str = "") -> bytes:
        """Serve the adapter in `path` (as the workers see it) as `name` over `base` (NAME@VERSION,
        or a one-version model's NAME; "" for the only version); its fingerprint. StatusError:
        INVALID_ARGUMENT naming the adapter and why it cannot be served (a name taken, a bad base, a
        worker's refusal), UNAVAILABLE naming it when a worker cannot take it now."""
        async with self._lock:
            catalog = self._catalog()
            table = self._adapters.table
            if name in catalog.names:
                raise _invalid(f"lora_name: `{name}` is the name of a served model; an adapter needs its own")
            if name in table.served or name in table.conflicts or name in catalog.declared_adapters:
                raise _invalid(f"lora_name: the adapter `{name}` has already been loaded")
            version_key = _base(catalog, base)
            workers = [w for w in self._registry.workers if w.routable and version_key in (None, w.version_key)]
            if not workers:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"lora_name: the adapter `{name}` cannot be loaded "
                                  f"now: no worker of {version_key or catalog.default_name} is serving")
            results = await _each(workers, lambda worker: worker.load_adapter(name, path, self._timeout_s))
            took = [(worker, result) for worker, result in results if isinstance(result, bytes)]
            failed = [(worker, result) for worker, result in results if isinstance(result, StatusError)]
            fingerprints = {fingerprint for _, fingerprint in took}
            if failed or len(fingerprints) > 1:
                await self._undo(name, [worker for worker, _ in took], lambda worker: worker.unload_adapter(
                    name, self._timeout_s))
                if failed:
                    raise _failure(name, "loaded", *failed[0])
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"lora_name: the adapter `{name}` read differently "
                                  f"on {len(fingerprints)} workers (is `{path}` the same directory on each?); "
                                  "nothing was loaded")
            ref = AdapterRef(name, took[0][1])
            await self._settled(lambda: all(worker.adapter(ref) for worker, _ in took), f"load of {name}")
            log.info("LoRA adapter %s loaded from %s on %d worker(s)", name, path, len(took))
            return took[0][1]

    async def unload(self, name: str) -> None:
        """Stop serving `name` on every worker that serves it. StatusError NOT_FOUND when none does,
        UNAVAILABLE naming it when a worker cannot let it go now (requests use it)."""
        async with self._lock:
            if name in self._catalog().declared_adapters:
                raise _invalid(f"lora_name: the adapter `{name}` is declared in the model repository file; remove "
                               "it there")
            held = [(worker, adapter) for worker in self._registry.workers if worker.routable
                    for adapter in worker.adapters if adapter.name == name]
            if not held:
                raise StatusError(grpc.StatusCode.NOT_FOUND, f"lora_name: the adapter `{name}` cannot be found")
            results = await _each([worker for worker, _ in held],
                                  lambda worker: worker.unload_adapter(name, self._timeout_s))
            # A worker that no longer serves it (a race with its restart) is where we want it.
            failed = [(worker, result) for worker, result in results
                      if isinstance(result, StatusError) and result.code != grpc.StatusCode.NOT_FOUND]
            if failed:
                paths = {worker.address: adapter.path for worker, adapter in held}
                removed = [worker for worker, result in results if not isinstance(result, StatusError)]
                await self._undo(name, removed, lambda worker: worker.load_adapter(name, paths[worker.address],
                                                                                     self._timeout_s))
                raise _failure(name, "unloaded", *failed[0])
            await self._settled(lambda: not any(adapter.name == name for worker, _ in held
                                                for adapter in worker.adapters), f"unload of {name}")
            log.info("LoRA adapter %s unloaded from %d worker(s)", name, len(held))

    async def _undo(self, name: str, workers: list[RemoteWorker],
                    call: Callable[[RemoteWorker], Awaitable[object]]) -> None:
        """Put `workers` back as they were; one that cannot be is logged (its reports show it)."""
        for worker, result in await _each(workers, call):
            if isinstance(result, StatusError):
                log.error("LoRA adapter %s: worker %s could not be put back as it was: %s: %s", name,
                          worker.address, result.code.name, result.message)

    async def _settled(self, done: Callable[[], bool], change: str) -> None:
        deadline = time.monotonic() + self._settle_s
        while not done():
            if time.monotonic() > deadline:
                log.warning("%s: the workers' load reports did not show it within %.0f s", change, self._settle_s)
                return
            await asyncio.sleep(_SETTLE_POLL_S)


async def _each(workers: list[RemoteWorker], call: Callable[[RemoteWorker], Awaitable[object]]
                ) -> list[tuple[RemoteWorker, object]]:
    """`call` on every worker at once: each one's result, or the StatusError it failed with."""
    results = await asyncio.gather(*(call(worker) for worker in workers), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, StatusError):
            raise result
    return list(zip(workers, results, strict=True))


def _base(catalog: ModelCatalog, base: str) -> str | None:
    """The version key (NAME@VERSION) of the base `base` names; None for a gateway of one model."""
    if catalog.repository is None:
        if base not in ("", catalog.default_name):
            raise _invalid(f"base_model_name: this server serves `{catalog.default_name}`, not `{base}`")
        return None
    versions = catalog.repository.versions
    if not base and len(versions) == 1:
        return versions[0].version_key
    name, at, _ = base.partition("@")
    model = catalog.repository.model(name)
    if model is not None and not at and len(model.versions) == 1:
        return model.versions[0].version_key
    if at and any(version.version_key == base for version in versions):
        return base
    raise _invalid(f"base_model_name: name the base version as NAME@VERSION (one of "
                   f"{', '.join(version.version_key for version in versions)}), got `{base}`")


def _invalid(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _failure(name: str, change: str, worker: RemoteWorker, error: StatusError) -> StatusError:
    """The answer to a change a worker refused: 400 where the adapter is at fault, else 503."""
    if error.code in _REFUSED:
        return _invalid(f"lora_name: the adapter `{name}` cannot be {change}: worker {worker.address}: "
                        f"{error.message}; nothing changed")
    return StatusError(grpc.StatusCode.UNAVAILABLE, f"lora_name: the adapter `{name}` cannot be {change} now: "
                       f"worker {worker.address}: {error.code.name}: {error.message}; nothing changed")
