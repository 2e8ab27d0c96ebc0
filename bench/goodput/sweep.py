"""The goodput suite's rate sweep, as pure decisions: which requests each rate gets, whether to go on
to a higher rate, and which rate to measure next between a passing and a failing one."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.common.metrics import Slo, goodput, passes
from bench.common.workload import BenchRequest


class RequestPool:
    """The workload's requests handed out in order, each rate its own slice, so no prompt reaches a
    server twice (its prefix cache would flatter the later rate) until the pool runs out: then it
    starts over, and says so."""

    def __init__(self, requests: Sequence[BenchRequest]) -> None:
        if not requests:
            raise ValueError("the request pool is empty")
        self._requests = list(requests)
        self._next = 0

    def take(self, count: int) -> list[BenchRequest]:
        """The next `count` requests."""
        taken = [self._requests[(self._next + i) % len(self._requests)] for i in range(count)]
        if self._next + count > len(self._requests):
            print(f"[goodput] the pool's {len(self._requests)} requests ran out: prompts are sent again "
                  "(a prefix cache may flatter this rate)", file=sys.stderr, flush=True)
        self._next = (self._next + count) % len(self._requests)
        return taken


def goes_higher(row: dict, slos: Sequence[Slo], stop_below: float) -> bool:
    """Whether a higher rate is worth measuring after `row`: not once the rate was not sustained (the
    queue only grows beyond it) or every objective's attainment fell below `stop_below`."""
    return row["sustained"] and any(row["attainment"][s.name] >= stop_below for s in slos)


def extension(row: dict, slo: Slo, factor: float = 1.25) -> float | None:
    """The next rate up when the highest measured one still passes (the edge is above the starting
    rates), a quarter higher; None once it fails."""
    return round(row["rate"] * factor, 3) if passes(row, slo) else None


def refinement(rows: Sequence[dict], slo: Slo, step_rps: float) -> float | None:
    """The rate halfway between the highest passing rate (every rate at or below it passes) and the
    lowest rate above it, while they are more than `step_rps` apart; None when the edge is found that
    closely, when no rate failed, or when none passed (a goodput of 0: capacity says the rest)."""
    found = goodput([(r["rate"], r["attainment"][slo.name], r["sustained"]) for r in rows])
    if not found["bounded"] or found["highest_passing"] == 0:
        return None
    highest = found["highest_passing"]
    failing = min(r["rate"] for r in rows if r["rate"] > highest and not passes(r, slo))
    if failing - highest <= step_rps:
        return None
    return round((highest + failing) / 2, 3)
