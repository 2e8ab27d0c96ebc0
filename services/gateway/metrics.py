"""The gateway's Prometheus metrics: vLLM's families as its clients see their requests, plus routing,
rejections and SLO attainment.

`tandem:key_*` account requests and tokens by the API key's configured name (services.gateway.caller;
"" without a key), never its secret.

`tandem:worker_routable` is read from the registry at each scrape (`watch_workers`): 1 for a
worker the router may send requests to, 0 for one it knows but skips (health not SERVING, or no load
report yet, as while a link between them is down and after, until the channel reconnects).

The prefix index, read at each scrape (`watch_prefix_index`): `tandem:prefix_index_info{index}` (1, for
the index routing uses: "exact", services.gateway.block_index, or "approximate",
services.gateway.approximate_index), `tandem:prefix_index_blocks` (block entries over every worker
and tier), and for the exact index `tandem:prefix_refused_workers`
(workers whose block hashes disagree with the gateway's, or are not yet checked: routed as holding
nothing), `tandem:prefix_probe_mismatches` (registration checks that failed). Per request,
`tandem:prefix_hit_tokens{tier}`: the prompt tokens its prefill site held, by the tier ("device",
"host", "disk") they came from (retries included).

`tandem:planner_recommended_replicas{role}` is read from the planner at each scrape
(`watch_planner`): the replicas it recommends for each model version's pool of each role, absent
while a pool cannot be measured.

vLLM's per-request phases and shapes are the gateway's (the workers see only their part of a request):
`services.gateway.telemetry` says what each is measured from.

Goodput, per model version (services.observability.metrics names the families):
- `tandem:requests_admitted`: requests admission placed on workers (at once or after a wait);
- `tandem:requests_served`: requests that finished with output (a final chunk);
- `tandem:requests_refused{reason}`: RESOURCE_EXHAUSTED (HTTP 429), before admission for
  "http_concurrency" (the HTTP API's requests in flight, before the request is read: labelled with
  the first model), "rate_limit" (the API key's limits), "queue_full" (admission's queue had no
  place) and "ttft_deadline" (no worker could meet the request's TTFT objective before it passed),
  after it for "workers_full" (every decode worker tried refused it: no KV room);
- `tandem:slo_requests{objective, attained}`: each served request once per objective, "ttft",
  "tpot" and "both" (met TTFT and TPOT), as the client saw its tokens. A request that set no
  objective (request.RequestedSlo 0) counts against the gateway's own, `--ttft-slo-ms` and
  `--tpot-slo-ms`, which admission and routing used for it too; so every served request counts, and
  `objective="both"` sums to `tandem:requests_served`.
A request counts once however many workers it took (retries, migrations).
Requests admitted but neither served nor refused failed otherwise (`tandem:request_rejections`) or
are still in flight. In PromQL, per model version (`sum by (model_name, model_version)` on each side
to add up several gateways):
  attainment, per objective: sum without(attained) (rate(tandem:slo_requests_total{attained="true"}[5m]))
                             / sum without(attained) (rate(tandem:slo_requests_total[5m]))
  goodput, requests/s that met both: rate(tandem:slo_requests_total{objective="both", attained="true"}[5m])
  its share of the admitted: rate(tandem:slo_requests_total{objective="both", attained="true"}[5m])
                             / ignoring(objective, attained) rate(tandem:requests_admitted_total[5m])
  refusals/s, by reason: rate(tandem:requests_refused_total[5m])

`GatewayMetrics.registry` is self-contained: the gRPC gateway serves it on `--metrics-port`, and an
HTTP front end can mount the same registry at `/metrics` (`prometheus_client.make_asgi_app`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.gateway.admission import QUEUE_FULL, TTFT_DEADLINE
from services.observability.metrics import (
    ITL_BUCKETS,
    MODEL,
    PARAMS_N_BUCKETS,
    REQUEST_BUCKETS,
    RequestMetrics,
    one_two_five_buckets,
    per_model,
)

# tandem:slo_requests's objectives, and tandem:requests_refused's reasons, at the gateway.
OBJECTIVES = ("ttft", "tpot", "both")
RATE_LIMIT, WORKERS_FULL, HTTP_CONCURRENCY = "rate_limit", "workers_full", "http_concurrency"
REFUSAL_REASONS = (HTTP_CONCURRENCY, RATE_LIMIT, QUEUE_FULL, TTFT_DEADLINE, WORKERS_FULL)


class GatewayMetrics(RequestMetrics):
    """Every metric the gateway exports."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        """`model_name`: the labels of what is not yet a model version's (the first model's name)."""
        self.registry = registry = registry or CollectorRegistry()
        self._running = Gauge("vllm:num_requests_running", "Requests streaming from a worker through the gateway.",
                              MODEL, registry=registry)
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests at the gateway not yet sent to a worker.",
                              MODEL, registry=registry)
        self._routed = Counter("tandem:routing_decisions", "Requests sent to a worker (retries included).",
                               per_model(["pool", "worker"]), registry=self.registry)
        self._rejected = Counter("tandem:request_rejections", "Requests that ended with an error status, by code.",
                                 per_model(["code"]), registry=self.registry)
        self._migrated = Counter("tandem:request_migrations",
                                 "Requests resumed on another decode worker after theirs failed mid-stream.",
                                 MODEL, registry=registry)
        self._placements = Counter("tandem:placements", "Requests placed (retries included), by kind: aggregated "
                                   "(one worker computes and decodes) or disaggregated (two).",
                                   per_model(["kind"]), registry=self.registry)
        # Usage by API key name (services.gateway.caller), "" for requests without a key: the keys are
        # configured, so the label's values are few.
        self._key_requests = Counter("tandem:key_requests", "Requests, by the API key they came with.",
                                     per_model(["key"]), registry=self.registry)
        self._key_prompt_tokens = Counter("tandem:key_prompt_tokens",
                                          "Prompt tokens used (charged to its rate limits), by API key.",
                                          per_model(["key"]), registry=self.registry)
        self._key_generation_tokens = Counter("tandem:key_generation_tokens",
                                              "Generated tokens used (charged to its rate limits), by API key.",
                                              per_model(["key"]), registry=self.registry)
        self._key_rate_limited = Counter("tandem:key_rate_limited", "Requests refused by their API key's rate limits.",
                                         per_model(["key"]), registry=self.registry)
        self._prefill_time = self._histogram("vllm:request_prefill_time_seconds",
                                             "Time spent in the PREFILL phase of a request.", REQUEST_BUCKETS)
        self._decode_time = self._histogram("vllm:request_decode_time_seconds",
                                            "Time spent in the DECODE phase of a request.", REQUEST_BUCKETS)
        self._inference_time = self._histogram("vllm:request_inference_time_seconds",
                                               "Time spent in the PREFILL and DECODE phases of a request.",
                                               REQUEST_BUCKETS)
        self._time_per_output_token = self._histogram("vllm:request_time_per_output_token_seconds",
                                                      "A request's decode time per output token after the first.",
                                                      ITL_BUCKETS)
        self._prefix_hit_tokens = Counter("tandem:prefix_hit_tokens",
                                          "Prompt tokens the chosen prefill site held, by the KV tier they come from.",
                                          per_model(["tier"]), registry=self.registry)
        self._params_n = self._histogram("vllm:request_params_n", "The n request parameter.", PARAMS_N_BUCKETS)
        self._length_families: _RequestLengths | None = None
        super().__init__(registry, model_name)

    def _bind(self, model_name: str, model_version: str) -> None:
        super()._bind(model_name, model_version)
        self.running = self._running.labels(*self.model)
        self.waiting = self._waiting.labels(*self.model)
        # The version's series exist (at 0) from the start, so a query or a test reading one before
        # its first event finds it.
        for family in self._per_version_families():
            family.labels(*self.model)
        self.count_outcomes(OBJECTIVES, REFUSAL_REASONS)

    def _per_version_families(self) -> list[Counter | Histogram]:
        lengths = self._length_families.families if self._length_families is not None else ()
        return [self._migrated, self._prefill_time, self._decode_time, self._inference_time,
                self._time_per_output_token, self._params_n, *lengths]

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, per_model(), registry=self.registry, buckets=buckets)

    def model_loaded(self, max_model_len: int) -> None:
        """Export the token-count histograms from now on: their buckets, as vLLM's, go up to the
        (longest served) model's context length, which is known only once the models are loaded."""
        self._length_families = _RequestLengths(self._histogram, max_model_len)
        for family in self._length_families.families:
            family.labels(*self.model)

    def request_finished(self, prompt_tokens: int, generation_tokens: int, max_tokens: int, prefill_s: float,
                         decode_s: float, time_per_output_token_s: float) -> None:
        """Account one finished request's token counts, max_tokens and phases (inference = prefill + decode)."""
        self._prefill_time.labels(*self.model).observe(prefill_s)
        self._decode_time.labels(*self.model).observe(decode_s)
        self._inference_time.labels(*self.model).observe(prefill_s + decode_s)
        self._time_per_output_token.labels(*self.model).observe(time_per_output_token_s)
        if self._length_families is not None:
            lengths = self._length_families
            lengths.prompt_tokens.labels(*self.model).observe(prompt_tokens)
            lengths.generation_tokens.labels(*self.model).observe(generation_tokens)
            lengths.max_tokens.labels(*self.model).observe(max_tokens)

    def choices_finished(self, n: int, max_generation_tokens: int) -> None:
        """Account the `n` choices of one prompt once all finished, the longest with this many tokens."""
        self._params_n.labels(*self.model).observe(n)
        if self._length_families is not None:
            self._length_families.max_generation_tokens.labels(*self.model).observe(max_generation_tokens)

    def watch_workers(self, workers: Callable[[], Iterable[tuple[str, str, bool, str | None]]]) -> None:
        """Export `tandem:worker_routable` from `workers()`: (role, address, routable, the NAME@VERSION
        its reports name or None before one came) of each worker the gateway knows, read at every scrape."""
        self.registry.register(_WorkerStates(self.model_name, workers))

    def watch_planner(self, recommended: Callable[[], Mapping[tuple[str | None, str], int | None]]) -> None:
        """Export `tandem:planner_recommended_replicas` from `recommended()`: the planner's replicas
        by (NAME@VERSION, or None for a gateway of one model; role), read at every scrape."""
        self.registry.register(_PlannerRecommendations(self.model_name, recommended))

    def watch_prefix_index(self, kind: str, blocks: Callable[[], int], refused: Callable[[], Iterable[str]],
                           mismatches: Callable[[], int]) -> None:
        """Export which prefix index routing uses (`kind`), its size, the workers whose block events
        it refuses (by address) and the failed registration checks, read at every scrape."""
        self.registry.register(_PrefixIndexStats(kind, blocks, refused, mismatches))

    def prefix_hit(self, tokens_by_tier: Mapping[str, int]) -> None:
        """Count a placed request's prompt tokens its prefill site held, by tier."""
        for tier, tokens in tokens_by_tier.items():
            if tokens:
                self._prefix_hit_tokens.labels(*self.model, tier).inc(tokens)

    def routed(self, pool: str, worker: str) -> None:
        """Count a request sent to `worker` of `pool` ("prefill" or "decode")."""
        self._routed.labels(*self.model, pool, worker).inc()

    def placed(self, kind: str) -> None:
        """Count a placement of `kind` ("aggregated" or "disaggregated")."""
        self._placements.labels(*self.model, kind).inc()

    def migrated(self) -> None:
        """Count a request moved to another decode worker mid-stream."""
        self._migrated.labels(*self.model).inc()

    def rejected(self, code: str) -> None:
        """Count a request that ended with this gRPC status code (its name)."""
        self._rejected.labels(*self.model, code).inc()

    def key_request(self, key: str) -> None:
        """Count a request that came with the key named `key` ("": none)."""
        self._key_requests.labels(*self.model, key).inc()

    def key_usage(self, key: str, prompt_tokens: int, generation_tokens: int) -> None:
        """Account the tokens a request of the key named `key` ("": none) used."""
        self._key_prompt_tokens.labels(*self.model, key).inc(prompt_tokens)
        self._key_generation_tokens.labels(*self.model, key).inc(generation_tokens)

    def key_rate_limited(self, key: str) -> None:
        """Count a request that its key's rate limits refused."""
        self._key_rate_limited.labels(*self.model, key).inc()

    def objectives(self, ttft_met: bool, tpot_met: bool) -> None:
        """Count a served request's objectives as met or missed: each, and both together."""
        self.slo("ttft", ttft_met)
        self.slo("tpot", tpot_met)
        self.slo("both", ttft_met and tpot_met)


class _RequestLengths:
    """vLLM's token-count histograms, bucketed 1, 2, 5, 10, ... up to the context length."""

    def __init__(self, histogram: Callable[[str, str, tuple[float, ...]], Histogram], max_model_len: int) -> None:
        buckets = one_two_five_buckets(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of a finished request.", buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Tokens generated for a finished request.", buckets)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.", buckets)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Tokens generated by the longest of a prompt's n choices.", buckets)

    @property
    def families(self) -> tuple[Histogram, ...]:
        """The four histograms."""
        return (self.prompt_tokens, self.generation_tokens, self.max_tokens, self.max_generation_tokens)


class _WorkerStates(Collector):
    """`tandem:worker_routable`, one sample a worker, as the registry sees them when scraped."""

    def __init__(self, model_name: str, workers: Callable[[], Iterable[tuple[str, str, bool, str | None]]]) -> None:
        self._model_name = model_name
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tandem:worker_routable",
                                   "1 while the gateway routes to the worker (health SERVING, load reports "
                                   "arriving), else 0.", labels=per_model(["role", "worker"]))
        for role, address, routable, version_key in self._workers():
            # A worker's own report names its model; before one came it counts as the gateway's first.
            family.add_metric([*_model_labels(self._model_name, version_key), role, address], 1.0 if routable else 0.0)
        yield family


class _PrefixIndexStats(Collector):
    """Which prefix index routing uses, its size and refusals, as the registry holds them when scraped."""

    def __init__(self, kind: str, blocks: Callable[[], int], refused: Callable[[], Iterable[str]],
                 mismatches: Callable[[], int]) -> None:
        self._kind = kind
        self._blocks = blocks
        self._refused = refused
        self._mismatches = mismatches

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = GaugeMetricFamily("tandem:prefix_index_info", "1 for the prefix index routing uses (exact: the "
                                 "workers' block events; approximate: the gateway's placements).", labels=["index"])
        info.add_metric([self._kind], 1.0)
        yield info
        yield GaugeMetricFamily("tandem:prefix_index_blocks", "Block entries in the gateway's prefix index, "
                                "over every worker and KV tier.", value=float(self._blocks()))
        refused = GaugeMetricFamily("tandem:prefix_refused_workers", "1 for each worker whose block events the "
                                    "gateway refuses (hashes that disagree, or not yet checked).", labels=["worker"])
        for address in self._refused():
            refused.add_metric([address], 1.0)
        yield refused
        yield CounterMetricFamily("tandem:prefix_probe_mismatches", "Workers' registration hash checks that "
                                  "failed: their block hashes disagreed with the gateway's.",
                                  value=float(self._mismatches()))


class _PlannerRecommendations(Collector):
    """`tandem:planner_recommended_replicas`, one sample a measured pool, as the planner last planned."""

    def __init__(self, model_name: str,
                 recommended: Callable[[], Mapping[tuple[str | None, str], int | None]]) -> None:
        self._model_name = model_name
        self._recommended = recommended

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tandem:planner_recommended_replicas",
                                   "Replicas the gateway's planner recommends for a model version's pool.",
                                   labels=per_model(["role"]))
        for (version, role), replicas in self._recommended().items():
            # A pool not yet measurable has no number; a 0 would read as "scale it away".
            if replicas is not None:
                family.add_metric([*_model_labels(self._model_name, version), role], float(replicas))
        yield family


def _model_labels(model_name: str, version_key: str | None) -> tuple[str, str]:
    """(model_name, model_version) of NAME@VERSION; `model_name` and "" for None (the gateway's one
    model, or a worker yet to report)."""
    if version_key is None:
        return model_name, ""
    name, _, version = version_key.partition("@")
    return name, version
