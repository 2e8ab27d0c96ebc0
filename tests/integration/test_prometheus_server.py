"""A real Prometheus server (Debian's `prometheus`, `make prometheus`) scraping a running mesh, the
shared pool's workers behind a gateway of this module's: the goodput series (services.gateway.metrics,
services.common.worker_metrics), the PromQL its docstring gives, and vLLM's dashboard's TTFT, TPOT
and throughput queries all return data through Prometheus's HTTP API."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from environment import missing
from shared_pool import NO_SLO, Pool, start_gateway
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from vllm_dashboard import DASHBOARD_QUERIES, dashboard_query

from harness.prometheus_server import PrometheusServer, Result, values
from harness.worker import WorkerProcess
from services.common.server import channel_options

HOUR_MS = 3_600_000
RPC_TIMEOUT_S = 300.0
SCRAPED_TIMEOUT_S = 60.0  # generous bound for the 1 s scrapes to see a change; nothing asserts timing


@pytest.fixture(scope="module")
def gateway(pool: Pool) -> Iterator[WorkerProcess]:
    gateway = start_gateway(pool.prefill, pool.decode, *NO_SLO)
    yield gateway
    assert gateway.stop() == 0


@pytest.fixture
def prometheus(pool: Pool, gateway: WorkerProcess, tmp_path: Path) -> Iterator[PrometheusServer]:
    binary = shutil.which("prometheus")
    if binary is None:
        missing("the prometheus binary (`make prometheus` installs Debian's package)")
    jobs = {"gateway": [gateway.http_address], "prefill": [w.metrics_address for w in pool.prefill],
            "decode": [w.metrics_address for w in pool.decode]}
    with PrometheusServer(jobs, tmp_path, binary) as server:
        yield server


def _generate(gateway: WorkerProcess, slo: common_pb2.Slo | None) -> None:
    request = gateway_pb2.GenerateRequest(text="Count to ten:", slo=slo,
                                          sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0.0,
                                                                             ignore_eos=True))
    with grpc.insecure_channel(gateway.address, options=channel_options()) as channel:
        chunks = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=RPC_TIMEOUT_S))
    assert chunks[-1].chunk.usage.completion_tokens == 6


def _all_up(result: Result) -> bool:
    return len(result) == 5 and all(sample["value"][1] == "1" for sample in result)


def test_goodput_and_vllms_dashboard_queries_through_a_real_prometheus(gateway, prometheus):
    prometheus.wait_for("up", _all_up, SCRAPED_TIMEOUT_S)
    decode_tpot = 'sum by (attained) (tandem:slo_requests_total{job="decode", objective="tpot"})'
    # Once scraped before the requests, every counter's first increment shows in rate().
    before = values(prometheus.wait_for(decode_tpot, lambda r: len(r) == 2, SCRAPED_TIMEOUT_S), "attained")
    prometheus.wait_for('tandem:requests_served_total{job="gateway"} == 0', timeout=SCRAPED_TIMEOUT_S)

    _generate(gateway, common_pb2.Slo(ttft_ms=HOUR_MS, tpot_ms=HOUR_MS))  # meets both
    _generate(gateway, common_pb2.Slo(ttft_ms=HOUR_MS, tpot_ms=1))  # meets TTFT only: 1 ms a token on a CPU
    _generate(gateway, None)  # the gateway's own objectives: 10 minutes each, met

    served = prometheus.wait_for('tandem:requests_served_total{job="gateway"} == 3', timeout=SCRAPED_TIMEOUT_S)
    model_name = served[0]["metric"]["model_name"]
    assert values(prometheus.query('tandem:requests_admitted_total{job="gateway"}')) == {None: 3}
    slo = prometheus.query('tandem:slo_requests_total{job="gateway"}')
    assert {(s["metric"]["objective"], s["metric"]["attained"]): float(s["value"][1]) for s in slo} == {
        ("ttft", "true"): 3, ("ttft", "false"): 0, ("tpot", "true"): 2, ("tpot", "false"): 1,
        ("both", "true"): 2, ("both", "false"): 1}
    refused = prometheus.query('tandem:requests_refused_total{job="gateway"}')
    assert set(values(refused, "reason").values()) == {0}
    assert set(values(refused, "reason")) == {"http_concurrency", "rate_limit", "queue_full", "ttft_deadline",
                                              "workers_full"}
    # The decode workers' own count: the same TPOT outcomes by their clocks (TTFT is the gateway's alone).
    after = values(prometheus.wait_for(decode_tpot, lambda r: sum(values(r, "attained").values())
                                       == sum(before.values()) + 3, SCRAPED_TIMEOUT_S), "attained")
    assert {attained: after[attained] - before[attained] for attained in after} == {"true": 2, "false": 1}

    # services.gateway.metrics' PromQL for attainment and goodput (over 5 minutes: since the first
    # scrape, when every series was 0, so rate() extrapolates each the same way).
    attainment = prometheus.query(
        'sum without(attained) (rate(tandem:slo_requests_total{job="gateway", attained="true"}[5m]))'
        ' / sum without(attained) (rate(tandem:slo_requests_total{job="gateway"}[5m]))')
    shares = values(attainment, "objective")
    assert shares["ttft"] == 1 and shares["tpot"] == shares["both"] == pytest.approx(2 / 3)
    goodput = prometheus.query(
        'rate(tandem:slo_requests_total{job="gateway", objective="both", attained="true"}[5m])'
        ' / ignoring(objective, attained) rate(tandem:requests_admitted_total{job="gateway"}[5m])')
    assert values(goodput) == {None: pytest.approx(2 / 3)}

    # vLLM's dashboard, as Grafana would query it: a number for each panel.
    for name in DASHBOARD_QUERIES:
        result = prometheus.query(dashboard_query(name, model_name, "5m"))
        numbers = [float(sample["value"][1]) for sample in result]
        assert numbers and all(math.isfinite(n) for n in numbers) and max(numbers) > 0, (name, result)
