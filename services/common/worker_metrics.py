"""A worker's Prometheus metrics: its requests (vLLM's families), its engine's state read at scrape
time, its KV transfers (prefill side) and, where NVML is present, its GPUs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.commands import GetStats
from engine.outputs import EngineStats, StepTokens
from engine.speculative.stats import SpecDecodeStats
from services.common.engine_loop import EngineLoop
from services.observability.gpu import gpu_collector
from services.observability.metrics import ITERATION_TOKENS_BUCKETS, TRANSFER_BUCKETS, RequestMetrics, per_model

log = logging.getLogger(__name__)

# A scrape waits at most this long for the engine thread to finish its step and read the stats.
_STATS_TIMEOUT_S = 5.0


class EngineStateCollector(Collector):
    """Gauges of the engine's load, read on the engine thread between steps when scraped (so an
    unscraped worker pays nothing for them)."""

    def __init__(self, loop: EngineLoop, model: tuple[str, str], reserved_requests: Callable[[], int] | None) -> None:
        self._loop = loop
        self._model = model
        self._reserved_requests = reserved_requests

    def collect(self) -> Iterator[Metric]:
        try:
            stats: EngineStats = self._loop.submit(GetStats()).result(_STATS_TIMEOUT_S)
        except (RuntimeError, FutureTimeout) as error:  # stopping, or a step that does not end
            log.info("metrics: engine stats unavailable: %s", error)
            return
        labels = list(self._model)
        gauges = [
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", stats.kv_usage),
            ("tandem:prefill_queued_tokens", "Prompt tokens waiting to be computed (the prefill pool's "
             "scaling signal).", stats.num_waiting_tokens),
            ("tandem:tensor_parallel_size", "Ranks the worker's model is split across (tensor parallelism).",
             self._loop.engine.config.tensor_parallel_size),
        ]
        if self._reserved_requests is not None:
            gauges.append(("tandem:kv_reserved_requests", "Requests whose KV is reserved here and still arriving.",
                           self._reserved_requests()))
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(name, documentation, labels=per_model())
            family.add_metric(labels, value)
            yield family
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Requests preempted (their KV dropped, to "
                                          "recompute later) to make room for others.", labels=per_model())
        preemptions.add_metric(labels, stats.num_preemptions)
        yield preemptions
        spec = self._loop.engine.config.speculative
        if stats.spec_decode is not None and spec is not None:
            yield from _spec_decode_counters(stats.spec_decode, spec.num_speculative_tokens, labels)


def _spec_decode_counters(stats: SpecDecodeStats, num_speculative_tokens: int, labels: list[str]) -> Iterator[Metric]:
    """vLLM's spec_decode counter families, from the engine's running totals."""
    counters = [
        ("vllm:spec_decode_num_drafts", "Drafts verified (one per request per speculating step).", stats.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", stats.num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens),
    ]
    for name, documentation, value in counters:
        family = CounterMetricFamily(name, documentation, labels=per_model())
        family.add_metric(labels, value)
        yield family
    per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Drafts whose token at this position was accepted.",
                                       labels=per_model(["position"]))
    accepted = stats.accepted_per_position
    for position in range(max(num_speculative_tokens, len(accepted))):
        per_position.add_metric([*labels, str(position)], accepted[position] if position < len(accepted) else 0)
    yield per_position


class WorkerMetrics(RequestMetrics):
    """Everything a prefill or decode worker exports; `registry` is what its /metrics serves."""

    def __init__(self, model_name: str, model_version: str = "", registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry or CollectorRegistry(), model_name, model_version)
        self._kv_bytes = Counter("tandem:kv_transfer_bytes", "KV cache bytes pushed to decode workers.",
                                 per_model(["backend"]), registry=self.registry)
        self._kv_seconds = Histogram("tandem:kv_transfer_seconds",
                                     "From a request's first pushed layer until the receiver had every page.",
                                     per_model(["backend"]), registry=self.registry, buckets=TRANSFER_BUCKETS)
        self._iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                           per_model(), registry=self.registry,
                                           buckets=ITERATION_TOKENS_BUCKETS).labels(*self.model)
        gpus = gpu_collector(self.model)
        if gpus is not None:
            self.registry.register(gpus)

    def watch_engine(self, loop: EngineLoop, reserved_requests: Callable[[], int] | None = None) -> None:
        """Export the engine's load from now on (once the engine is loaded), and on a decode worker
        the requests whose KV is still arriving."""
        self.registry.register(EngineStateCollector(loop, self.model, reserved_requests))
        loop.observe_steps(self._step)

    def _step(self, tokens: StepTokens) -> None:
        # The step's batch in tokens: prompt chunks, decode tokens and the drafts they verified.
        self._iteration_tokens.observe(tokens.prefill + tokens.decode)

    def kv_transfer(self, backend: str, num_bytes: int, seconds: float) -> None:
        """Account one request's delivered KV transfer."""
        self._kv_bytes.labels(*self.model, backend).inc(num_bytes)
        self._kv_seconds.labels(*self.model, backend).observe(seconds)
