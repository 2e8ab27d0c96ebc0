"""The gateway follows its model repository file: a change to it (a new version, a new split, a
version removed) takes effect without a restart, for the requests that arrive after it.

The file is polled (services.repository.file_stamp, once a second), re-read and validated whole;
a file that does not validate, or a new version whose tokenizer cannot be read, leaves the previous
repository serving and is logged with why. Requests already placed keep their version: a split
moved to a new version drains the old one as its requests finish.
"""

from __future__ import annotations

import asyncio
import logging

from services.gateway.catalog import ModelCatalog
from services.gateway.service import GatewayService
from services.repository.config import load_repository
from services.repository.file_stamp import FileStamp

log = logging.getLogger(__name__)


class RepositoryWatch:
    """Reloads `service`'s catalog from `path` when the file changes."""

    def __init__(self, path: str, service: GatewayService, max_model_len: int | None = None,
                 interval_s: float = 1.0) -> None:
        self._path = path
        self._service = service
        self._max_model_len = max_model_len
        self._interval_s = interval_s
        self._stamp = FileStamp(path)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Poll the file from the running event loop."""
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def reload(self) -> None:
        """Re-read the file now; ValueError (the previous repository still serving) when it is refused."""
        repository = await asyncio.to_thread(load_repository, self._path)
        previous = self._service.served_catalog()
        try:
            catalog = await asyncio.to_thread(ModelCatalog.load, repository, self._max_model_len, previous)
        except (OSError, ValueError) as error:
            raise ValueError(f"{self._path}: a version could not be loaded: {error}") from error
        self._service.catalog = catalog
        log.info("model repository %s reloaded: %s", self._path, catalog.describe())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            if self._service.catalog is None or not self._stamp.changed():
                continue
            try:
                await self.reload()
            except ValueError as error:
                log.error("model repository not reloaded, the previous one keeps serving: %s", error)
