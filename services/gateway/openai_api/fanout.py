"""Several core requests run at once (a body's n choices, or its batch of prompts), their chunks merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from services.common.chunk import Chunk
from services.gateway.catalog import Target
from services.gateway.choices import ChoiceGroup
from services.gateway.request import GenerateRequest
from services.gateway.service import GatewayService

# What a request's task reports: (index, chunk, None), (index, None, None) at its end, or
# (index, None, error) when it failed.
_Event = tuple[int, Chunk | None, Exception | None]


class FanOut:
    """Start every request at once; read their chunks, tagged with the request's index, as they come.

    The first failure of any request is raised to the reader. `close` (or leaving `async with`)
    cancels whatever still runs.
    """

    def __init__(self, service: GatewayService, requests: Sequence[GenerateRequest], target: Target,
                 n: int = 1) -> None:
        """`requests`: `n` choices of each prompt, prompt-major, all run on `target`, the one
        version the body's `model` resolved to."""
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._held: list[tuple[int, Chunk]] = []
        self._running = len(requests)
        metrics = service.metrics.labelled(target.served_name, target.version)
        groups = [ChoiceGroup(metrics, n) for _ in range(0, len(requests), n)]
        self._tasks = [asyncio.create_task(self._run(service, index, request, target, groups[index // n]))
                       for index, request in enumerate(requests)]

    async def __aenter__(self) -> FanOut:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def started(self) -> None:
        """Wait until every request has streamed its first chunk (or ended), so that a request the
        gateway refuses fails here, before a reply is begun."""
        waiting = set(range(len(self._tasks)))
        while waiting and (item := await self._next()) is not None:
            self._held.append(item)
            waiting.discard(item[0])

    async def chunks(self) -> AsyncIterator[tuple[int, Chunk]]:
        """Every request's chunks in arrival order, each with its request's index."""
        held, self._held = self._held, []
        for item in held:
            yield item
        while (item := await self._next()) is not None:
            yield item

    async def close(self) -> None:
        """Cancel the requests still running and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _next(self) -> tuple[int, Chunk] | None:
        """The next chunk of any request; None once every request has ended."""
        while self._running:
            index, chunk, error = await self._queue.get()
            if error is not None:
                raise error
            if chunk is not None:
                return index, chunk
            self._running -= 1
        return None

    async def _run(self, service: GatewayService, index: int, request: GenerateRequest, target: Target,
                   group: ChoiceGroup) -> None:
        try:
            async for chunk in service.generate(request, target=target, group=group):
                self._queue.put_nowait((index, chunk, None))
            self._queue.put_nowait((index, None, None))
        except Exception as error:  # handed to the reader, who answers it as an API error
            self._queue.put_nowait((index, None, error))
