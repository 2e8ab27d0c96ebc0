"""How much of their latency objectives a pool's workers would use for a typical request, as the
gateway predicts it: the autoscaling signal of a pool of colocated workers. Each of them computes
prompts and decodes, so neither a prompt queue nor a decode batch alone says whether it is full;
the router's predictions weigh both on one scale, the objectives.

`tandem:pool_slo_use{role}` is, for each pool, the sum over its routable workers of what the recent
typical request (a moving average of the requests placed) would use of its objectives placed on that
worker alone (services.gateway.router.slo_use): an autoscaler keeping its per-replica average at a
target below 1 (HPA External metric, AverageValue) keeps each worker's predictions within the
objectives. Read from the registry at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.gateway.router import RouteRequest, SloTargets
from services.observability.metrics import per_model

# The moving averages follow about the last hundred requests.
_WEIGHT = 0.01


class RecentRequests:
    """Moving averages of the placed requests' prompt and output lengths."""

    def __init__(self) -> None:
        self._prompt_tokens = 0.0
        self._max_tokens = 0.0

    def observe(self, prompt_tokens: int, max_tokens: int) -> None:
        if not self._prompt_tokens:
            self._prompt_tokens, self._max_tokens = float(prompt_tokens), float(max_tokens)
            return
        self._prompt_tokens += _WEIGHT * (prompt_tokens - self._prompt_tokens)
        self._max_tokens += _WEIGHT * (max_tokens - self._max_tokens)

    def typical(self, slo: SloTargets) -> RouteRequest | None:
        """A request of the averages' lengths under `slo`; None before any request was placed."""
        if not self._prompt_tokens:
            return None
        return RouteRequest(max(1, round(self._prompt_tokens)), max(1, round(self._max_tokens)), slo)


class PoolSloUse(Collector):
    """`tandem:pool_slo_use`, one sample a pool (model version and role) with routable workers."""

    def __init__(self, model_name: str, pools: Callable[[], Mapping[tuple[str | None, str], float]]) -> None:
        """`pools()`: each pool's use, keyed by (NAME@VERSION or None, role)."""
        self._model_name = model_name
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tandem:pool_slo_use",
                                   "Summed over a pool's workers: the share of its latency objectives the recent "
                                   "typical request would use placed on the worker (the larger of TTFT and TPOT).",
                                   labels=per_model(["role"]))
        for (version_key, role), use in self._pools().items():
            name, _, version = version_key.partition("@") if version_key else (self._model_name, "", "")
            family.add_metric([name, version, role], use)
        yield family
