"""The pure arithmetic of the goodput benchmark: arrival schedules, per-rate summaries, goodput.

Goodput follows DistServe: the highest request rate at which at least 90% of requests meet both
their TTFT and their TPOT objective; and it is a *sustained* rate: each rate is offered for at least
60 s of Poisson arrivals (and at least 30 requests), and counts only if the system served at least
0.95x the rate offered. Otherwise a queue that absorbs a short burst passes rates the system cannot
keep up with. The served rate is read from departures, (completed - 1) / (last finish - first
finish): a system that keeps up finishes requests as fast as they arrive, one that falls behind
finishes them at its capacity however fast they come. The offered rate is the arrivals' own, (sent -
1) / (last arrival - first arrival), so the draw's chance does not count against a system.

Imports only the standard library and numpy, so unit tests and every part of the goodput suite can
use it without the HTTP client or matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness.token_timer import tpot

PERCENTILES = (50, 90, 99)
ATTAINMENT_TARGET = 0.9
SERVED_FRACTION = 0.95  # of the offered rate, for a rate to count as sustained
ARRIVAL_SPAN_S = 60.0
MIN_REQUESTS = 30


@dataclass(frozen=True)
class Slo:
    """A pair of latency objectives a request must meet together."""

    name: str
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO {self.name}: TTFT and TPOT must be positive, got {self.ttft_s}, {self.tpot_s}")

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`TTFT_MS:TPOT_MS`, e.g. `2000:100`; named after its values."""
        ttft, _, tpot = text.partition(":")
        try:
            ttft_ms, tpot_ms = float(ttft), float(tpot)
        except ValueError:
            raise ValueError(f"SLO {text!r}: expected TTFT_MS:TPOT_MS, e.g. 2000:100") from None
        return cls(f"ttft{ttft_ms:g}ms_tpot{tpot_ms:g}ms", ttft_ms / 1e3, tpot_ms / 1e3)

    def met_by(self, result: RequestResult) -> bool:
        """Whether a request completed within both objectives (a failed request never does)."""
        return self.ttft_met_by(result) and result.tpot_s <= self.tpot_s

    def ttft_met_by(self, result: RequestResult) -> bool:
        """Whether a request completed with its first token within the TTFT objective."""
        return result.ok and result.ttft_s <= self.ttft_s


@dataclass(frozen=True)
class RequestResult:
    """What the client saw of one request. Times are seconds; for a failed request only `error` counts."""

    ok: bool
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    output_tokens: int = 0
    started_s: float = 0.0  # since the first arrival of its rate
    finished_s: float = 0.0
    error: str = ""


def token_timing(sent_at: float, first_at: float, last_at: float, tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) from the send time and the arrival times of the first and last token:
    TPOT = (last − first) / (tokens − 1), 0 for a single token."""
    return first_at - sent_at, tpot(first_at, last_at, tokens)


def requests_for(rate: float, span_s: float = ARRIVAL_SPAN_S, minimum: int = MIN_REQUESTS) -> int:
    """How many requests to send at `rate` so that their Poisson arrivals span at least `span_s`
    seconds but by chance (the expected span plus two standard deviations), and at least `minimum`."""
    expected = rate * span_s
    return max(minimum, math.ceil(expected + 2 * math.sqrt(expected)) + 1)


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """`count` arrival times (seconds from the first, which is at 0) of a Poisson process of
    `rate` requests/s; the same arguments always give the same schedule."""
    if rate <= 0 or count < 1:
        raise ValueError(f"need a positive rate and at least one request, got rate={rate}, count={count}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 by linear interpolation between closest ranks (None when there are no values)."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)}


def attainment(results: Sequence[RequestResult], slo: Slo) -> float:
    """The fraction of all sent requests (failures included, as misses) that met the SLO."""
    return sum(slo.met_by(r) for r in results) / len(results) if results else 0.0


def ttft_attainment(results: Sequence[RequestResult], slo: Slo) -> float:
    """The fraction of all sent requests that met the SLO's TTFT objective."""
    return sum(slo.ttft_met_by(r) for r in results) / len(results) if results else 0.0


def _per_second(times: Sequence[float]) -> float:
    """Events per second between the first and the last of `times` (0 for fewer than two)."""
    span = max(times, default=0.0) - min(times, default=0.0)
    return (len(times) - 1) / span if len(times) > 1 and span > 0 else 0.0


def summarize_rate(rate: float, results: Sequence[RequestResult], slos: Sequence[Slo]) -> dict:
    """One rate's figures: TTFT/TPOT percentiles (ms, completed requests), attainment per SLO (and of
    its TTFT alone), the offered and served rates (module docstring) and whether the rate was
    sustained, the arrivals' span, and output tokens/s from the first send to the last finish."""
    done = [r for r in results if r.ok]
    span = max((r.finished_s for r in results), default=0.0) - min((r.started_s for r in results), default=0.0)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "rate": rate,
        "requests": len(results),
        "completed": len(done),
        "errors": errors,
        "ttft_ms": {k: None if v is None else v * 1e3 for k, v in percentiles([r.ttft_s for r in done]).items()},
        "tpot_ms": {k: None if v is None else v * 1e3 for k, v in percentiles([r.tpot_s for r in done]).items()},
        "attainment": {slo.name: attainment(results, slo) for slo in slos},
        "ttft_attainment": {slo.name: ttft_attainment(results, slo) for slo in slos},
        "offered_rps": (offered := _per_second([r.started_s for r in results])),
        "served_rps": (served := _per_second([r.finished_s for r in done])),
        "sustained": served >= SERVED_FRACTION * offered > 0,
        "arrival_span_s": max((r.started_s for r in results), default=0.0) - min((r.started_s for r in results),
                                                                                  default=0.0),
        "output_tps": sum(r.output_tokens for r in done) / span if span > 0 else 0.0,
        "duration_s": span,
    }


def passes(row: dict, slo: Slo, target: float = ATTAINMENT_TARGET) -> bool:
    """Whether a summarized rate counts for goodput at `slo`: sustained, and attained by `target`."""
    return row["sustained"] and row["attainment"][slo.name] >= target


def capacity(rows: Sequence[dict], slo: Slo, target: float = ATTAINMENT_TARGET) -> dict:
    """What a system serves, whatever the objectives: `served_rps`, the most it served at any rate;
    `ttft_rps`, the highest offered rate it sustained while meeting the TTFT objective for `target`
    of requests (what a goodput of 0 is read against)."""
    ttft = [r["rate"] for r in rows if r["sustained"] and r["ttft_attainment"][slo.name] >= target]
    return {"served_rps": max((r["served_rps"] for r in rows), default=0.0), "ttft_rps": max(ttft, default=0.0)}


def goodput(curve: Sequence[tuple[float, float, bool]], target: float = ATTAINMENT_TARGET) -> dict:
    """Goodput from (rate, attainment, sustained) points: `highest_passing` is the highest tested rate
    at or below which every tested rate was sustained and reached `target`; `interpolated` moves on
    linearly towards the next, failing rate to where the attainment crosses `target` (not past a rate
    that failed by not being sustained: how much of it would be is unknown). `bounded` is False when
    no tested rate failed, so the true goodput may be higher; both are 0 when the lowest rate fails."""
    highest, attained = 0.0, 1.0
    for rate, value, sustained in sorted(curve):
        if value < target or not sustained:
            fraction = (attained - target) / (attained - value) if sustained else 0.0
            interpolated = highest + fraction * (rate - highest) if highest else 0.0
            return {"highest_passing": highest, "interpolated": interpolated, "bounded": True}
        highest, attained = rate, value
    return {"highest_passing": highest, "interpolated": highest, "bounded": False}
