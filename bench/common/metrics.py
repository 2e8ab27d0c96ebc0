"""The pure arithmetic of the goodput benchmark: arrival schedules, per-rate summaries, goodput.

Goodput follows DistServe: the highest request rate at which at least 90% of requests meet both
their TTFT and their TPOT objective. Imports only the standard library and numpy, so unit tests
and every part of the goodput suite can use it without the HTTP client or matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harness.token_timer import tpot

PERCENTILES = (50, 90, 99)
ATTAINMENT_TARGET = 0.9


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
        return result.ok and result.ttft_s <= self.ttft_s and result.tpot_s <= self.tpot_s


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


def summarize_rate(rate: float, results: Sequence[RequestResult], slos: Sequence[Slo]) -> dict:
    """One rate's figures: TTFT/TPOT percentiles (ms, completed requests), attainment per SLO,
    completed requests/s and output tokens/s over the span from the first send to the last finish."""
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
        "throughput_rps": len(done) / span if span > 0 else 0.0,
        "output_tps": sum(r.output_tokens for r in done) / span if span > 0 else 0.0,
        "duration_s": span,
    }


def goodput(curve: Sequence[tuple[float, float]], target: float = ATTAINMENT_TARGET) -> dict:
    """Goodput from (rate, attainment) points: `highest_passing` is the highest tested rate at or
    below which every tested rate reaches `target`; `interpolated` moves on linearly towards the next,
    failing rate to where the curve crosses `target`. `bounded` is False when no tested rate failed,
    so the true goodput may be higher; both are 0 when even the lowest rate fails."""
    points = sorted(curve)
    highest, attained = 0.0, 1.0
    for rate, value in points:
        if value < target:
            fraction = (attained - target) / (attained - value)
            interpolated = highest + fraction * (rate - highest) if highest else 0.0
            return {"highest_passing": highest, "interpolated": interpolated, "bounded": True}
        highest, attained = rate, value
    return {"highest_passing": highest, "interpolated": highest, "bounded": False}
