"""The requests a worker is serving, each run as its own task so that an Abort RPC can cancel it.

Cancelling the task runs the request's own cleanup (its `finally` blocks free what it holds), the
same path as a client that goes away; the RPC then ends with CANCELLED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from services.common.failure import Failure, WorkerError

T = TypeVar("T")


class InflightRequests:
    """request id -> the task serving it, plus a count of the requests that ended."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self.finished = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tasks

    async def run(self, request_id: str, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` as the request's task and return its result.

        ValueError if the id is already in flight; WorkerError CANCELLED if `abort` cancelled it.
        If the caller is cancelled (the client went away), the task is cancelled too and this
        returns only after its cleanup ran.
        """
        if request_id in self._tasks:
            work.close()
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        task = asyncio.ensure_future(work)
        self._tasks[request_id] = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                raise WorkerError(Failure.CANCELLED, f"request {request_id!r} was aborted") from None
            raise
        finally:
            del self._tasks[request_id]
            self.finished += 1

    def abort(self, request_id: str) -> bool:
        """Cancel a request's task; False if no such request is in flight."""
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True
