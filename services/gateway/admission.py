"""Admission: run a request now, make it wait for capacity in a bounded queue, or refuse it.

A request runs at once when some way of running it meets its SLO now, or when none could even on
idle workers (its SLO is out of reach whatever the load: waiting would not help, so it runs on the
best option). Otherwise it waits, ordered by priority (higher first) then TTFT deadline (sooner
first), and is placed as soon as a way meets its SLO with the time it has waited taken off its TTFT
budget. At its TTFT deadline, or when a better-ranked request needs its place in a full queue, it
is refused with a retry-after hint. Nothing here waits without a deadline.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.gateway.router import Decision, RouteRequest, SloTargets

log = logging.getLogger(__name__)

class Claim(Protocol):
    """A placed request's hold on its workers' capacity."""

    def release(self) -> None:
        """The request ended: its load leaves the workers it was counted against."""
        ...


C = TypeVar("C", bound=Claim)


# Why admission refuses a request: the queue has no place for it, or its TTFT deadline passed in it.
QUEUE_FULL, TTFT_DEADLINE = "queue_full", "ttft_deadline"


class Rejected(Exception):
    """The gateway cannot take the request now (RESOURCE_EXHAUSTED / HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        """`reason`: QUEUE_FULL or TTFT_DEADLINE."""
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class Placer(Protocol[C]):
    """What admission needs of the worker registry."""

    def decide(self, request: RouteRequest, idle: bool = False) -> Decision:
        """The router's decision on the current load (or, with idle, on workers with nothing to do)."""
        ...

    def claim(self, request: RouteRequest, decision: Decision) -> C:
        """Count the request against the chosen workers at once (before the next decision)."""
        ...


@dataclass(order=True)
class _Waiter:
    rank: tuple[int, float, int]  # (-priority, deadline, arrival order)
    request: RouteRequest = field(compare=False)
    deadline: float = field(compare=False)
    placed: asyncio.Future = field(compare=False)


class Admission(Generic[C]):
    """The gateway's admission queue over a placer (see the module docstring)."""

    def __init__(self, placer: Placer[C], max_queued: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_queued < 0:
            raise ValueError(f"max_queued: must be >= 0, got {max_queued}")
        self._placer = placer
        self._max_queued = max_queued
        self._clock = clock
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()
        self._drain_scheduled = False

    @property
    def queued(self) -> int:
        """Requests waiting for capacity now."""
        return len(self._waiting)

    async def admit(self, request: RouteRequest, priority: int = 0, arrived_at: float | None = None) -> C:
        """The request's claim on its workers once placed; raises Rejected, or NoWorkerError when
        no worker could run it at all."""
        now = self._clock()
        deadline = (arrived_at if arrived_at is not None else now) + request.slo.ttft_s
        decision = self._placer.decide(request)
        if decision.meets_slo:
            return self._placer.claim(request, decision)
        if not self._placer.decide(request, idle=True).meets_slo:
            log.info("no worker could meet the SLO even idle; running on the best option: %s", decision.reasons[0])
            return self._placer.claim(request, decision)
        waiter = _Waiter((-priority, deadline, next(self._order)), request, deadline,
                         asyncio.get_running_loop().create_future())
        self._enqueue(waiter, decision)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.placed), max(0.0, deadline - self._clock()))
        except TimeoutError:
            if _placed(waiter):
                return waiter.placed.result()  # placed just as the deadline passed
            self._remove(waiter)
            raise Rejected(f"no worker can meet TTFT {request.slo.ttft_s * 1e3:.0f} ms / TPOT "
                           f"{request.slo.tpot_s * 1e3:.0f} ms now: {decision.reasons[0]}",
                           _retry_after(decision), TTFT_DEADLINE) from None
        except asyncio.CancelledError:
            if _placed(waiter):  # the caller went away just as it was placed
                waiter.placed.result().release()
            raise
        finally:
            if not waiter.placed.done():
                self._remove(waiter)
                waiter.placed.cancel()

    def changed(self) -> None:
        """Load changed (a report arrived, a request ended): try the waiting requests again, soon."""
        if self._waiting and not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _enqueue(self, waiter: _Waiter, decision: Decision) -> None:
        if len(self._waiting) >= self._max_queued:
            worst = self._waiting[-1] if self._waiting else None
            if worst is None or worst < waiter:
                raise Rejected(f"the admission queue is full ({self._max_queued} requests wait for capacity)",
                               _retry_after(decision), QUEUE_FULL)
            self._waiting.pop()
            worst.placed.set_exception(Rejected("the admission queue is full and a request with a higher "
                                                "priority or an earlier deadline took this one's place",
                                                _retry_after(decision), QUEUE_FULL))
        bisect.insort(self._waiting, waiter)

    def _remove(self, waiter: _Waiter) -> None:
        index = bisect.bisect_left(self._waiting, waiter)
        if index < len(self._waiting) and self._waiting[index] is waiter:
            del self._waiting[index]

    def _drain(self) -> None:
        """Place every waiting request that now fits, best-ranked first; each placement is claimed
        before the next decision, so a burst of capacity is not handed out twice."""
        self._drain_scheduled = False
        now = self._clock()
        for waiter in list(self._waiting):
            if waiter.placed.done():
                self._remove(waiter)
                continue
            left = waiter.deadline - now
            if left <= 0:
                continue  # its own timeout refuses it
            budget = dataclasses.replace(waiter.request, slo=SloTargets(left, waiter.request.slo.tpot_s))
            decision = self._placer.decide(budget)
            if decision.meets_slo:
                self._remove(waiter)
                waiter.placed.set_result(self._placer.claim(waiter.request, decision))


def _placed(waiter: _Waiter) -> bool:
    return waiter.placed.done() and not waiter.placed.cancelled() and waiter.placed.exception() is None


def _retry_after(decision: Decision) -> float:
    """Seconds after which trying again is worth it: about when the predicted first token would come."""
    return max(1.0, round(decision.ttft_s, 1))
