"""What a Tandem gateway's log says about one rate of the goodput benchmark: where the prompts were
computed, how many requests admission refused, and how the router's TTFT predictions compared with
what happened. Two runs of one configuration can differ by more than a design change does (goodput
runs E and F in docs/benchmarks.md's history); these figures say whether routing is why.

The gateway logs each finished request as `request finished {json}` (services/gateway/telemetry.py)
and each refusal as `request ... failed: RESOURCE_EXHAUSTED: ...`; lines are selected by their
timestamps, so a rate's window must not overlap another's.
"""

from __future__ import annotations

import json
import statistics
from datetime import datetime

_FINISHED = "request finished "
_REFUSED = "failed: RESOURCE_EXHAUSTED"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"


def _timestamp(line: str) -> float | None:
    """The logging module's default `asctime` (local time) at the start of a line, as epoch seconds."""
    try:
        return datetime.strptime(line[:23], _TIME_FORMAT).timestamp()
    except ValueError:
        return None


def summarize_routing(lines: list[str], started: float, ended: float) -> dict:
    """Routing figures of the requests that finished or were refused within [started, ended]
    (epoch seconds): prompts computed by a prefill worker and by the decode worker itself
    ("local"), refusals, and the ratio of actual to predicted TTFT (p10/p50/p90) of each."""
    computed = {"prefill_worker": 0, "local": 0}
    ratios: dict[str, list[float]] = {"prefill_worker": [], "local": []}
    refused = 0
    for line in lines:
        at = _timestamp(line)
        if at is None or not started <= at <= ended:
            continue
        if _REFUSED in line:
            refused += 1
            continue
        _, found, payload = line.partition(_FINISHED)
        if not found:
            continue
        record = json.loads(payload)
        where = "local" if record.get("prefill_worker") == "local" else "prefill_worker"
        computed[where] += 1
        if record.get("predicted_ttft_s", 0) > 0:
            ratios[where].append(record["ttft_s"] / record["predicted_ttft_s"])
    return {"prompts_computed": computed, "refused": refused,
            "ttft_actual_over_predicted": {where: _quantiles(values) for where, values in ratios.items()}}


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    if len(values) == 1:
        return {"p10": values[0], "p50": values[0], "p90": values[0], "n": 1}
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return {"p10": deciles[0], "p50": statistics.median(values), "p90": deciles[-1], "n": len(values)}


def read_routing(path: str, started: float, ended: float) -> dict | None:
    """`summarize_routing` of the log at `path`; None when there is no such log (not Tandem)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return summarize_routing(file.readlines(), started, ended)
    except FileNotFoundError:
        return None
