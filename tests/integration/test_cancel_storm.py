"""The cancellation storm against a real disaggregated mesh (two prefill and two decode worker
processes behind a gateway, prefix caching on): 200 requests over gRPC and HTTP, half cancelled by
their clients before prefill, during the KV transfer or mid-decode. Nothing may leak, every request
that was not cancelled gets all its tokens, and the mesh answers as before. `make bench` runs the
same storm with 1,000 requests (`python -m bench cancel_storm`)."""

from __future__ import annotations

import pytest
from shared_pool import NO_SLO, Pool, start_gateway

from harness.leak_check import assert_no_leaks
from harness.mesh import Mesh
from harness.storm import StormConfig, run_storm


@pytest.fixture(scope="module")
def mesh(pool: Pool):
    # The shared workers (their formats and cache size do not matter to cancellation); the objectives
    # no request can miss: the storm is about cancellation, not admission.
    gateway = start_gateway(pool.prefill, pool.decode, *NO_SLO)
    yield Mesh(pool.prefill, pool.decode, gateway)
    assert gateway.stop() == 0, gateway.log_tail()


def test_cancellation_storm_leaks_nothing_and_the_mesh_still_serves(mesh):
    report = run_storm(mesh, StormConfig(requests=200, concurrency=8, seed=7))
    print(report.summary())
    assert not report.problems(), "\n".join([*report.problems(), report.summary()])
    # Every cancellation point and both APIs were exercised, with some requests completing.
    points = {point for point, _, status in report.counts if status == "cancelled"}
    assert points == {"before_prefill", "during_transfer", "mid_decode"}, report.summary()
    assert {api for _, api, status in report.counts if status == "cancelled"} == {"grpc", "http"}, report.summary()
    assert_no_leaks(mesh.workers)
