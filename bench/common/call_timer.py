"""How the routing microbenchmarks time the gateway: the median of a call repeated many times (a
median, since a shared machine's interruptions land on a few calls), and one drain of an
admission queue."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

from services.gateway.admission import Admission


def median_call_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn`, each timed on its own."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


async def drain_s(admission: Admission, waiting: list[asyncio.Task]) -> float:
    """Seconds of one drain of `admission`'s queue (every waiter re-decided), then its waiters,
    `waiting`, cancelled."""
    started = time.perf_counter()
    admission.changed()
    await asyncio.sleep(0)  # the drain runs here
    elapsed = time.perf_counter() - started
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    return elapsed
