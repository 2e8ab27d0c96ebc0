"""A worker's /metrics over real HTTP on loopback, asked as Prometheus asks: the names keep their
colons (vLLM's dashboards query `vllm:...`), whatever format the scraper prefers."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter

from services.observability.metrics import serve_metrics

# What Prometheus 2.42 (Debian's) sends when it scrapes: OpenMetrics first.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_a_scraper_preferring_openmetrics_gets_the_names_with_their_colons() -> None:
    registry = CollectorRegistry()
    Counter("vllm:generation_tokens", "Generated tokens.", ["model_name"], registry=registry).labels("m").inc(3)
    address = serve_metrics(registry, "127.0.0.1", 0)
    request = urllib.request.Request(f"http://{address}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(request, timeout=30) as response:
        content_type = response.headers["Content-Type"]
        body = response.read().decode()
    assert content_type.startswith("text/plain")
    assert 'vllm:generation_tokens_total{model_name="m"} 3.0' in body.splitlines()
    assert "vllm_generation_tokens" not in body
