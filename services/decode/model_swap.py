"""Hot swap inside one decode or colocated worker process (`tandem worker --pool P`).

The worker follows its model repository file as the gateway does (polled once a second). When the
file assigns the worker's pool another version, the worker:

1. predicts what the new version will hold (engine.footprint: its weights in the format it will
   serve them in, and its KV cache) and refuses, with a log line naming both sizes and the limit, if
   that beside what the process holds now exceeds `--memory-limit-mib` (or no limit was given);
2. loads it beside the version serving, on a thread at the lowest CPU priority so that the serving
   version keeps the cores (a version that fails to load is logged with why and the old one keeps
   serving), profiles it and makes it the one new requests get: its load reports name it,
   and the old version among `retiring_versions`, so the gateway may still route the old one here;
3. unloads the old version once the repository has routed no traffic to it (its split weight is 0,
   or the file no longer lists it) for `retire_after_s` and its last request has finished.

A roll-out is therefore two edits of the file: assign the pool the new version (both are served),
then move the split to it (the old one drains and is unloaded). Rollback is the same two edits
back; while the old version is still loaded, going back to it loads nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from engine.engine import Engine
from engine.footprint import Footprint, predict_footprint, resident_bytes
from services.common.worker import load_engine
from services.decode.served_engines import ServedEngines
from services.repository.config import ModelRepository, ModelVersion, load_repository
from services.repository.file_stamp import FileStamp
from services.repository.swap_settings import SwapSettings

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
_BACKGROUND_NICE = 19  # the loading thread's niceness: the least CPU share Linux gives


def memory_refusal(settings: SwapSettings, serving: str, wanted: str, resident: int,
                   footprint: Footprint) -> str | None:
    """Why loading `wanted` beside `serving` is refused, or None when it fits the memory limit."""
    prefix = f"hot swap of pool {settings.pool} to {wanted} refused, {serving} keeps serving"
    if settings.memory_limit_bytes is None:
        return (f"{prefix}: loading a version beside the one serving needs --memory-limit-mib (what the worker "
                "may hold with both loaded); without it, restart the worker to change its version")
    needed = resident + footprint.total_bytes
    if needed <= settings.memory_limit_bytes:
        return None
    return (f"{prefix}: the process holds {resident / _MIB:.0f} MiB and {wanted} needs about "
            f"{footprint.total_bytes / _MIB:.0f} MiB (weights {footprint.weight_bytes / _MIB:.0f} MiB, KV cache "
            f"{footprint.kv_cache_bytes / _MIB:.0f} MiB): {needed / _MIB:.0f} MiB exceeds --memory-limit-mib "
            f"{settings.memory_limit_bytes // _MIB}")


def routes_traffic(repository: ModelRepository, version_key: str) -> bool:
    """Whether requests naming the model (not the version) may get `version_key` under `repository`."""
    name, _, version = version_key.partition("@")
    model = repository.model(name)
    return model is not None and any(entry.name == version for entry, _ in model.weights)


class ModelSwap:
    """Follows the repository file for one worker process's pool; see the module docstring."""

    def __init__(self, settings: SwapSettings, engines: ServedEngines, flags: EngineConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`flags`: the worker's engine config before a version is applied to it (ModelVersion.serving)."""
        self._settings = settings
        self._engines = engines
        self._flags = flags
        self._clock = clock
        self._stamp = FileStamp(settings.repository)
        self._repository = load_repository(settings.repository)
        self._unrouted_since: dict[str, float] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Poll from the running event loop until `stop`."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop polling (a swap under way is abandoned; its engine was never served)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll(self) -> None:
        """Read the file if it changed and follow it; unload the retiring versions that are done."""
        if self._stamp.changed():
            try:
                self._repository = await asyncio.to_thread(load_repository, self._settings.repository)
            except ValueError as error:
                log.error("model repository not reloaded, the worker keeps its version: %s", error)
            else:
                await self._follow()
        await self._retire()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.interval_s)
            await self.poll()

    async def _follow(self) -> None:
        current = self._engines.current
        assert current is not None  # started once the first version serves
        try:
            version = self._repository.for_pool(self._settings.pool)
        except ValueError as error:
            log.error("%s keeps serving: %s", current.version_key, error)
            return
        if version.version_key == current.version_key:
            return
        loaded = self._engines.find(version.version_key)
        if loaded is not None:
            self._engines.promote(loaded)
            log.info("pool %s serves %s again (still loaded); %s retires", self._settings.pool, version.version_key,
                     current.version_key)
            return
        await self._load(version, current.version_key)

    async def _load(self, version: ModelVersion, serving: str) -> None:
        config = version.serving(self._flags)
        try:
            footprint = await asyncio.to_thread(predict_footprint, config)
        except (OSError, ValueError) as error:
            log.error("hot swap of pool %s to %s failed, %s keeps serving: %s", self._settings.pool,
                      version.version_key, serving, error)
            return
        refusal = memory_refusal(self._settings, serving, version.version_key, resident_bytes(), footprint)
        if refusal is not None:
            log.error("%s", refusal)
            return
        log.info("pool %s: loading %s beside %s (about %.0f MiB)", self._settings.pool, version.version_key, serving,
                 footprint.total_bytes / _MIB)
        try:
            engine = await _in_background(load_engine, config)
        except Exception as error:  # whatever the new weights do, the old version keeps serving
            log.error("hot swap of pool %s to %s failed, %s keeps serving: %s", self._settings.pool,
                      version.version_key, serving, error)
            return
        current = self._engines.current
        assert current is not None
        worker = current.successor(engine)
        await self._engines.start(worker)
        self._engines.promote(worker)
        log.info("pool %s now serves %s; %s retires (%.0f MiB resident)", self._settings.pool, version.version_key,
                 serving, resident_bytes() / _MIB)

    async def _retire(self) -> None:
        now = self._clock()
        for worker in self._engines.retiring:
            key = worker.version_key
            if routes_traffic(self._repository, key):
                self._unrouted_since.pop(key, None)
                continue
            since = self._unrouted_since.setdefault(key, now)
            if now - since >= self._settings.retire_after_s and not len(worker.inflight):
                await self._engines.unload(worker)
                self._unrouted_since.pop(key, None)
                log.info("pool %s: %s unloaded (%.0f MiB resident)", self._settings.pool, key,
                         resident_bytes() / _MIB)


async def _in_background(load: Callable[[EngineConfig], Engine], config: EngineConfig) -> Engine:
    """`load(config)` on a thread of its own at the lowest CPU priority (Linux nices threads one by
    one), so that reading and converting the new weights yields the cores to the version serving."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="model-swap-load", initializer=_lower_priority)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, load, config)
    finally:
        pool.shutdown(wait=False)


def _lower_priority() -> None:
    with contextlib.suppress(OSError):  # not Linux, or not permitted: load at normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BACKGROUND_NICE)
