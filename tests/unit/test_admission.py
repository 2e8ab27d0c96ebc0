"""Admission rules over a scripted placer (our own interface, standing in for the worker registry)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from services.gateway.admission import QUEUE_FULL, TTFT_DEADLINE, Admission, Rejected
from services.gateway.router import Decision, RouteRequest, SloTargets


class Claim:
    def __init__(self, placer: ScriptedPlacer, request: RouteRequest) -> None:
        self.request = request
        self._placer = placer

    def release(self) -> None:
        self._placer.claimed.remove(self.request)


class ScriptedPlacer:
    """Meets the SLO while fewer than `capacity` requests are claimed; idle it always meets unless told."""

    def __init__(self, capacity: int, idle_meets: bool = True) -> None:
        self.capacity = capacity
        self.idle_meets = idle_meets
        self.claimed: list[RouteRequest] = []

    def decide(self, request: RouteRequest, idle: bool = False) -> Decision:
        meets = self.idle_meets if idle else len(self.claimed) < self.capacity
        return Decision("d1", "p1", 0.5, 0.05, meets, 1.0, ("prefill p1 -> decode d1: scripted",))

    def claim(self, request: RouteRequest, decision: Decision) -> Claim:
        self.claimed.append(request)
        return Claim(self, request)


def req(tokens: int = 100, ttft: float = 5.0) -> RouteRequest:
    return RouteRequest(prompt_tokens=tokens, max_tokens=16, slo=SloTargets(ttft, 0.1))


class SteppingClock:
    """A clock that is `step` seconds later at every reading: time passes while admission works."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


async def run_others_until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run (no time passes) until `condition` holds."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the other tasks never got there")


def test_a_request_that_fits_is_placed_at_once() -> None:
    async def scenario() -> None:
        placer = ScriptedPlacer(capacity=1)
        claim = await Admission(placer, max_queued=4).admit(req())
        assert placer.claimed == [claim.request]

    asyncio.run(scenario())


def test_a_slo_out_of_reach_even_when_idle_runs_on_the_best_option() -> None:
    async def scenario() -> None:
        placer = ScriptedPlacer(capacity=0, idle_meets=False)
        await Admission(placer, max_queued=4).admit(req())
        assert len(placer.claimed) == 1

    asyncio.run(scenario())


def test_a_waiting_request_is_placed_when_capacity_frees() -> None:
    async def scenario() -> None:
        placer = ScriptedPlacer(capacity=1)
        admission = Admission(placer, max_queued=4)
        first = await admission.admit(req())
        second = asyncio.create_task(admission.admit(req(200)))
        await run_others_until(lambda: admission.queued == 1)
        assert not second.done()
        first.release()
        admission.changed()
        claim = await asyncio.wait_for(second, 5)
        assert claim.request.prompt_tokens == 200 and admission.queued == 0

    asyncio.run(scenario())


def test_a_request_still_waiting_at_its_ttft_deadline_is_rejected_with_a_retry_hint() -> None:
    async def scenario() -> None:
        placer = ScriptedPlacer(capacity=0)
        # Each reading is a second later: by the time it would wait, the 100 ms budget is spent.
        admission = Admission(placer, max_queued=4, clock=SteppingClock(1.0))
        with pytest.raises(Rejected) as rejected:
            await admission.admit(req(ttft=0.1))
        assert rejected.value.retry_after_s >= 1.0
        assert "TTFT 100 ms" in str(rejected.value)
        assert rejected.value.reason == TTFT_DEADLINE
        assert admission.queued == 0 and placer.claimed == []

    asyncio.run(scenario())


def test_a_full_queue_refuses_the_lowest_ranked_request() -> None:
    async def scenario() -> None:
        placer = ScriptedPlacer(capacity=0)
        admission = Admission(placer, max_queued=2)
        low = [asyncio.create_task(admission.admit(req(), priority=0)) for _ in range(2)]
        await run_others_until(lambda: admission.queued == 2)
        with pytest.raises(Rejected, match="queue is full") as full:
            await admission.admit(req(), priority=0)  # no better than those waiting
        assert full.value.reason == QUEUE_FULL
        high = asyncio.create_task(admission.admit(req(), priority=5))
        await run_others_until(low[1].done)
        # The later-deadline low-priority request gave its place to the high-priority one.
        assert low[1].done() and isinstance(low[1].exception(), Rejected)
        assert low[1].exception().reason == QUEUE_FULL
        assert not low[0].done() and admission.queued == 2
        placer.capacity = 1
        admission.changed()
        claim = await asyncio.wait_for(high, 5)  # placed first: it ranks first
        assert not low[0].done()
        claim.release()
        admission.changed()
        await asyncio.wait_for(low[0], 5)

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        placer = ScriptedPlacer(capacity=0)
        admission = Admission(placer, max_queued=4)
        waiting = asyncio.create_task(admission.admit(req()))
        await run_others_until(lambda: admission.queued == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert admission.queued == 0

    asyncio.run(scenario())
