"""Prometheus metrics every Tandem process shares: vLLM's per-request families, the requests'
outcomes and objectives, and their HTTP server.

Names follow vLLM where vLLM has the metric (so its dashboards and the Gateway API Inference
Extension read ours), `tandem:` otherwise; every family carries `model_name` and `model_version`
labels. Each process
keeps its own `CollectorRegistry` rather than the global one, so tests and embedders can hold
several, and the gateway's can be mounted on an HTTP app (`prometheus_client.make_asgi_app`).

vLLM has no family for what goodput needs, so these are Tandem's, the same names at the gateway and
at the workers (each counts its own side; the scrape's `job` tells them apart):
`tandem:requests_admitted`, `tandem:requests_served` (finished with output) and
`tandem:requests_refused{reason}` (RESOURCE_EXHAUSTED, HTTP 429), and
`tandem:slo_requests{objective, attained}` (served requests by whether they met an objective).
services.gateway.metrics and services.common.worker_metrics say what each side counts, and give the
PromQL for attainment and goodput.
"""

from __future__ import annotations

import copy
import logging
import socket
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

log = logging.getLogger(__name__)

# vLLM's buckets, so that histograms from both aggregate.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
# The `n` request parameter, and the tokens one engine step computed.
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# KV transfers of one prompt: milliseconds on one machine, more across a network.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Every family's first labels: the model's name (vLLM's label) and, in a deployment with a model
# repository, the version ("" without one), so that an A/B split's versions compare side by side.
MODEL = ("model_name", "model_version")


def per_model(labels: Sequence[str] = ()) -> tuple[str, ...]:
    """Label names of a family: `model_name` and `model_version` first, then `labels`."""
    return (*MODEL, *labels)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for a request's token counts, whose
    top is the model's context length."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class RequestMetrics:
    """vLLM's per-request families, as one process (gateway or worker) measures its requests, bound
    to one model version's labels; `labelled` gives the same families bound to another's."""

    def __init__(self, registry: CollectorRegistry, model_name: str, model_version: str = "") -> None:
        self.registry = registry
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", MODEL,
                               registry=registry, buckets=TTFT_BUCKETS)
        self._inter_token = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", MODEL,
                                      registry=registry, buckets=ITL_BUCKETS)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", MODEL,
                              registry=registry, buckets=REQUEST_BUCKETS)
        self._queue_time = Histogram("vllm:request_queue_time_seconds", "Time a request waited to be scheduled.",
                                     MODEL, registry=registry, buckets=REQUEST_BUCKETS)
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", MODEL,
                                      registry=registry)
        self._generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", MODEL, registry=registry)
        self._success = Counter("vllm:request_success", "Requests that finished, by why.",
                                per_model(["finished_reason"]), registry=registry)
        # Hit rate = rate(hits) / rate(queries), both in prompt tokens, as vLLM counts them.
        self._prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                             "Prompt tokens looked up in the prefix cache.", MODEL, registry=registry)
        self._prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                          MODEL, registry=registry)
        self._admitted = Counter("tandem:requests_admitted", "Requests taken on (see the process's metrics).",
                                 MODEL, registry=registry)
        self._served = Counter("tandem:requests_served", "Requests that finished with output.", MODEL,
                               registry=registry)
        self._refused = Counter("tandem:requests_refused", "Requests refused for capacity (RESOURCE_EXHAUSTED, "
                                "HTTP 429), by why.", per_model(["reason"]), registry=registry)
        self._slo = Counter("tandem:slo_requests", "Served requests, by latency objective and whether they met it.",
                            per_model(["objective", "attained"]), registry=registry)
        self._views: dict[tuple[str, str], Self] = {}
        self._bind(model_name, model_version)

    def _bind(self, model_name: str, model_version: str) -> None:
        """Bind every family to this model version's labels (a subclass binds its own families too)."""
        self.model = (model_name, model_version)
        self.model_name = model_name
        self.ttft = self._ttft.labels(*self.model)
        self.inter_token = self._inter_token.labels(*self.model)
        self.e2e = self._e2e.labels(*self.model)
        self.queue_time = self._queue_time.labels(*self.model)
        self.prompt_tokens = self._prompt_tokens.labels(*self.model)
        self.generation_tokens = self._generation_tokens.labels(*self.model)
        self.prefix_cache_queries = self._prefix_cache_queries.labels(*self.model)
        self.prefix_cache_hits = self._prefix_cache_hits.labels(*self.model)

    def labelled(self, model_name: str, model_version: str) -> Self:
        """The same families (one registry) bound to another model version's labels."""
        key = (model_name, model_version)
        if key == self.model:
            return self
        if key not in self._views:
            view = copy.copy(self)
            view._bind(model_name, model_version)
            self._views[key] = view
        return self._views[key]

    def succeeded(self, finished_reason: str) -> None:
        """Count a request that finished ("stop", "length" or "abort")."""
        self._success.labels(*self.model, finished_reason).inc()

    def count_outcomes(self, objectives: Sequence[str], refusal_reasons: Sequence[str]) -> None:
        """Export this version's outcome series, and those of these objectives and refusal reasons, at
        0 from now on: a query's rate() sees a counter's first increment only after a scrape saw it at 0."""
        self._admitted.labels(*self.model)
        self._served.labels(*self.model)
        for reason in refusal_reasons:
            self._refused.labels(*self.model, reason)
        for objective in objectives:
            for attained in ("true", "false"):
                self._slo.labels(*self.model, objective, attained)

    def admitted(self) -> None:
        """Count a request taken on."""
        self._admitted.labels(*self.model).inc()

    def served(self) -> None:
        """Count a request that finished with output."""
        self._served.labels(*self.model).inc()

    def refused(self, reason: str) -> None:
        """Count a request refused for capacity, and why."""
        self._refused.labels(*self.model, reason).inc()

    def slo(self, objective: str, attained: bool) -> None:
        """Count a served request's latency objective (`objective` names it) as met or missed."""
        self._slo.labels(*self.model, objective, "true" if attained else "false").inc()

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Account one prompt's lookup in the prefix cache."""
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)

    def output_gap(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` new output tokens arrived `seconds` after the previous ones."""
        for _ in range(num_tokens):
            self.inter_token.observe(seconds / num_tokens)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> str:
    """Serve `registry` over HTTP on host:port (0 = a free port) from a daemon thread, for the life
    of the process; the host:port actually bound."""

    class Handler(_TextExpositionHandler):
        served = registry

    server = (_IPv6Server if ":" in host else ThreadingHTTPServer)((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    address = f"{host}:{server.server_port}"
    log.info("metrics on http://%s/metrics", address)
    return address


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _TextExpositionHandler(BaseHTTPRequestHandler):
    """Answers every GET with the registry in Prometheus's text format, whatever the Accept header.

    prometheus_client's own server answers a scraper that prefers OpenMetrics (Prometheus 2 does) in
    OpenMetrics, whose sample lines it writes with the colons of `vllm:` and `tandem:` names turned
    into underscores (prometheus/client_python#1177): no dashboard would find them. The text format
    keeps the names, and every Prometheus reads it (the gateway's /metrics serves it too)."""

    served: CollectorRegistry

    def do_GET(self) -> None:
        body = generate_latest(self.served)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a scrape a second is no news."""


def default_metrics_port(grpc_port: int, metrics_port: int | None) -> int:
    """The `--metrics-port` to use: as given, else the gRPC port + 1000 (0 when that is 0)."""
    if metrics_port is not None:
        if not 0 <= metrics_port <= 65535:
            raise ValueError(f"--metrics-port: {metrics_port} is not a TCP port")
        return metrics_port
    if not grpc_port:
        return 0
    if grpc_port + 1000 > 65535:
        raise ValueError(f"--metrics-port: the default (gRPC port {grpc_port} + 1000) is not a TCP port; give one")
    return grpc_port + 1000
