"""A worker's Prometheus metrics: its requests (vLLM's families), its engine's state read at scrape
time, its KV transfers (prefill side) and, where NVML is present, its GPUs.

A decode or colocated worker counts its side of goodput (services.decode.telemetry), under the
gateway's names (services.gateway.metrics): `tandem:requests_admitted` once a request's KV has room
(reserved for a prompt computed elsewhere; in the running batch for one computed here, which the
engine queues until then and never refuses), `tandem:requests_refused{reason="no_kv_room"}` when it
has none (RESOURCE_EXHAUSTED: the gateway tries another worker), `tandem:requests_served` when it
finished, and `tandem:slo_requests{objective="tpot"}` for a served request against the TPOT
objective the gateway sent with it, by the worker's own clock (from its first token here to its
last; the gateway's TPOT adds the network). Its TTFT objective is the gateway's alone: most of a
request's TTFT is spent before the decode worker sees it (admission, the prefill worker). A worker's
share of its requests that met TPOT, in PromQL:
  sum without(attained) (rate(tandem:slo_requests_total{objective="tpot", attained="true"}[5m]))
  / sum without(attained) (rate(tandem:slo_requests_total{objective="tpot"}[5m]))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.commands import GetStats
from engine.config import EngineConfig
from engine.outputs import EngineStats, StepTokens
from engine.speculative.stats import SpecDecodeStats
from services.common.engine_loop import EngineLoop
from services.observability.gpu import gpu_collector
from services.observability.metrics import ITERATION_TOKENS_BUCKETS, TRANSFER_BUCKETS, RequestMetrics, per_model

log = logging.getLogger(__name__)

# A scrape waits at most this long for the engine thread to finish its step and read the stats.
_STATS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WatchedEngine:
    """An engine whose load a worker exports, with its model version's labels."""

    loop: EngineLoop
    model: tuple[str, str]
    reserved_requests: Callable[[], int] | None


class EngineStateCollector(Collector):
    """Gauges of the engines' load, read on each engine's thread between steps when scraped (so an
    unscraped worker pays nothing for them): one engine, or two while a hot swap retires one, each
    family once with a series per model version."""

    def __init__(self) -> None:
        self.engines: list[WatchedEngine] = []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for engine in list(self.engines):
            for family in _engine_families(engine):
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        yield from families.values()


def _engine_families(engine: WatchedEngine) -> Iterator[Metric]:
    loop = engine.loop
    try:
        stats: EngineStats = loop.submit(GetStats()).result(_STATS_TIMEOUT_S)
    except (RuntimeError, FutureTimeout) as error:  # stopping, or a step that does not end
        log.info("metrics: engine stats unavailable: %s", error)
        return
    labels = list(engine.model)
    gauges = [
        ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
        ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
        ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", stats.kv_usage),
        ("tandem:prefill_queued_tokens", "Prompt tokens waiting to be computed (the prefill pool's "
         "scaling signal).", stats.num_waiting_tokens),
        ("tandem:tensor_parallel_size", "Ranks the worker's model is split across (tensor parallelism).",
         loop.engine.config.tensor_parallel_size),
        ("tandem:expert_parallel_size", "Ranks the worker's experts are split across whole (expert parallelism; "
         "1: none).", loop.engine.config.parallel_sizes["expert_parallel_size"]),
        ("tandem:prefill_context_parallel_size", "Processes a long prompt's prefill is split across by sequence "
         "(1: none).", loop.engine.config.prefill_context_parallel_size),
        ("tandem:pipeline_parallel_size", "Stage processes the worker's layers are split across (1: none).",
         loop.engine.config.pipeline_parallel_size),
    ]
    if engine.reserved_requests is not None:
        gauges.append(("tandem:kv_reserved_requests", "Requests whose KV is reserved here and still arriving.",
                       engine.reserved_requests()))
    for name, documentation, value in gauges:
        family = GaugeMetricFamily(name, documentation, labels=per_model())
        family.add_metric(labels, value)
        yield family
    if stats.max_loras:
        yield _lora_requests_info(stats, labels)
    preemptions = CounterMetricFamily("vllm:num_preemptions", "Requests preempted (their KV dropped, to "
                                      "recompute later) to make room for others.", labels=per_model())
    preemptions.add_metric(labels, stats.num_preemptions)
    yield preemptions
    if loop.engine.config.cache.budget_tokens is not None:
        steps = CounterMetricFamily("tandem:kv_budget_steps", "Engine steps under a KV budget by the attention they "
                                    "ran: scored (gathers each request's held blocks and scores them: a prompt's "
                                    "observation window, decode rows, evicted requests) or regular (the backend "
                                    "without a budget).", labels=per_model(["attention"]))
        for attention in ("scored", "regular"):
            steps.add_metric([*labels, attention], stats.kv_budget_steps.get(attention, 0))
        yield steps
    if stats.kv_tiers:
        yield from _kv_tier_families(stats, labels)
    spec = loop.engine.config.speculative
    if stats.spec_decode is not None and spec is not None:
        yield from _spec_decode_counters(stats.spec_decode, spec.num_speculative_tokens, labels)


def _lora_requests_info(stats: EngineStats, labels: list[str]) -> Metric:
    """vLLM's vllm:lora_requests_info: the adapters with running and waiting requests (comma-separated
    names) and --max-loras as labels, the time of the reading as its value, as vLLM sets it. Read
    when scraped, so only the current series is exported (vLLM's gauge keeps every past one)."""
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=per_model(["max_lora", "waiting_lora_adapters", "running_lora_adapters"]))
    adapters = stats.lora_adapters
    running = ",".join(state.name for state in adapters if state.running_requests)
    waiting = ",".join(state.name for state in adapters if state.waiting_requests)
    info.add_metric([*labels, str(stats.max_loras), waiting, running], time.time())
    return info


# Per lower KV tier (engine.kv_tiers), labelled tier="host"|"disk": (name, help, TierStats field, counter?).
_TIER_FAMILIES = (
    ("tandem:kv_tier_hits", "Blocks loaded back from the tier, checked.", "hits", True),
    ("tandem:kv_tier_misses", "Blocks looked for in the tier and not found intact.", "misses", True),
    ("tandem:kv_tier_corrupt_blocks", "Blocks that failed their check when read back (each also a miss).",
     "corrupt", True),
    ("tandem:kv_tier_errors", "Tier operations that failed (a full or gone disk, an unreachable host tier owner).",
     "errors", True),
    ("tandem:kv_tier_written_bytes", "Bytes of blocks written to the tier.", "bytes_written", True),
    ("tandem:kv_tier_read_bytes", "Bytes of blocks read back from the tier.", "bytes_read", True),
    ("tandem:kv_tier_loaded_blocks", "Blocks loaded into the KV cache from the tier.", "loaded_blocks", True),
    ("tandem:kv_tier_load_seconds", "Time spent loading blocks from the tier into the KV cache.", "load_seconds", True),
    ("tandem:kv_tier_blocks", "Blocks the tier holds (the host tier: those this worker stored there).",
     "stored_blocks", False),
    ("tandem:kv_tier_bytes", "Bytes the tier holds (the disk tier).", "stored_bytes", False),
    ("tandem:kv_tier_capacity_bytes", "The tier's bound in bytes (the disk tier).", "capacity_bytes", False),
)


def _kv_tier_families(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    """vLLM's external prefix cache counters (prompt tokens) and each lower tier's own families."""
    for name, documentation, value in (
            ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the lower KV tiers after a device "
             "prefix-cache miss.", stats.external_prefix_cache_queries),
            ("vllm:external_prefix_cache_hits", "Prompt tokens loaded back from the lower KV tiers.",
             stats.external_prefix_cache_hits),
            ("tandem:kv_tier_dropped_blocks", "Blocks not copied to the lower KV tiers because their writes "
             "were too far behind.", stats.kv_tier_dropped_blocks),
            ("tandem:kv_tier_load_wait_seconds", "Time steps' forwards waited before a layer's attention for the "
             "lower KV tiers' loads to write it (what the overlap with the prompt's compute did not hide).",
             stats.kv_tier_load_wait_s),
            ("tandem:kv_tier_first_layer_wait_seconds", "Of tandem:kv_tier_load_wait_seconds, the time before a "
             "step's first layer.", stats.kv_tier_first_layer_wait_s)):
        counter = CounterMetricFamily(name, documentation, labels=per_model())
        counter.add_metric(labels, value)
        yield counter
    for name, documentation, field, is_counter in _TIER_FAMILIES:
        kind = CounterMetricFamily if is_counter else GaugeMetricFamily
        family = kind(name, documentation, labels=per_model(["tier"]))
        for tier, tier_stats in stats.kv_tiers.items():
            family.add_metric([*labels, tier], getattr(tier_stats, field))
        yield family


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
        registry = registry or CollectorRegistry()
        self._kv_bytes = Counter("tandem:kv_transfer_bytes", "KV cache bytes pushed to decode workers.",
                                 per_model(["backend"]), registry=registry)
        self._kv_seconds = Histogram("tandem:kv_transfer_seconds",
                                     "From a request's first pushed layer until the receiver had every page.",
                                     per_model(["backend"]), registry=registry, buckets=TRANSFER_BUCKETS)
        self._iteration_tokens_family = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                                  per_model(), registry=registry, buckets=ITERATION_TOKENS_BUCKETS)
        super().__init__(registry, model_name, model_version)
        self._engines = EngineStateCollector()
        self.registry.register(self._engines)
        gpus = gpu_collector(self.model)
        if gpus is not None:
            self.registry.register(gpus)

    def _bind(self, model_name: str, model_version: str) -> None:
        super()._bind(model_name, model_version)
        self._iteration_tokens = self._iteration_tokens_family.labels(*self.model)

    def watch_engine(self, loop: EngineLoop, reserved_requests: Callable[[], int] | None = None) -> None:
        """Export the engine's load, labelled with its model version, from now on (once the engine is
        loaded), and on a decode worker the requests whose KV is still arriving."""
        config = loop.engine.config
        view = self.labelled(config.served_name, config.model_version)
        self._engines.engines.append(WatchedEngine(loop, view.model, reserved_requests))
        loop.observe_steps(view._step)

    def of_request(self, config: EngineConfig, lora_name: str = "") -> WorkerMetrics:
        """The families bound to the model a request asked for: its LoRA adapter (adapters share the
        served model's namespace: its `model_name` label is the name the request gave) or the
        served model, at the served version."""
        return self.labelled(lora_name or config.served_name, config.model_version)

    def unwatch(self, loop: EngineLoop) -> None:
        """Stop exporting an unloaded engine's load (a version a hot swap retired)."""
        self._engines.engines = [engine for engine in self._engines.engines if engine.loop is not loop]

    def _step(self, tokens: StepTokens) -> None:
        # The step's batch in tokens: prompt chunks, decode tokens and the drafts they verified.
        self._iteration_tokens.observe(tokens.prefill + tokens.decode)

    def kv_transfer(self, backend: str, num_bytes: int, seconds: float) -> None:
        """Account one request's delivered KV transfer."""
        self._kv_bytes.labels(*self.model, backend).inc(num_bytes)
        self._kv_seconds.labels(*self.model, backend).observe(seconds)
