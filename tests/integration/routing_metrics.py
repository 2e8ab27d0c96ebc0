"""The gateway's routing counts and a poll, shared by the mesh fault tests (loopback and hosts) and the
routing tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric


def prefill_attempts(families: Iterable[Metric]) -> dict[str, float]:
    """The gateway's attempts so far (retries included) per prefill worker ("local": none)."""
    return {sample.labels["worker"]: sample.value
            for family in families if family.name == "tandem:routing_decisions"
            for sample in family.samples
            if sample.name.endswith("_total") and sample.labels["pool"] == "prefill"}


def placements(families: Iterable[Metric]) -> dict[str, float]:
    """The gateway's placements so far (retries included) by kind: aggregated or disaggregated."""
    return {sample.labels["kind"]: sample.value
            for family in families if family.name == "tandem:placements"
            for sample in family.samples if sample.name.endswith("_total")}


def increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counts that grew from `before` to `after`, by how much."""
    return {worker: count - before.get(worker, 0) for worker, count in after.items() if count > before.get(worker, 0)}


def poll(condition: Callable[[], bool], what: str, deadline_s: float) -> None:
    """Wait until `condition()` holds; fail naming `what` after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
