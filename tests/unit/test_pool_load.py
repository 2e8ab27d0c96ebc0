"""The flexible pool's autoscaling signal (services.gateway.pool_load): what the recent typical
request would use of the objectives on each pool's workers, as the gateway exports it."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from tandem.v1 import common_pb2

from services.common.convert import step_model_to_proto
from services.common.step_model import StepModel
from services.gateway.pool_load import PoolSloUse, RecentRequests
from services.gateway.registry import WorkerRegistry
from services.gateway.router import Decision, SloTargets, WorkerView, slo_use

# 1 ms a prompt token, 20 ms a decode step plus 2 ms a sequence.
MODEL = StepModel(base_s=0.020, per_prompt_token_s=0.001, per_sequence_s=0.002)
SLO = SloTargets(ttft_s=1.0, tpot_s=0.050)


def test_a_request_uses_the_larger_share_of_its_two_objectives() -> None:
    request = RecentRequests()
    request.observe(300, 100)
    typical = request.typical(SLO)
    assert typical is not None and (typical.prompt_tokens, typical.max_tokens) == (300, 100)
    idle = WorkerView("c1", "colocated", free_kv_blocks=100, block_size=16, step_model=MODEL, chunk_tokens=512)
    # TTFT 20 + 300 ms + the hop against 1 s; TPOT 22 ms against 50 ms: the TPOT share is larger.
    assert slo_use(typical, idle) == pytest.approx(MODEL.token_s(1, 350) / 0.050)
    queued = WorkerView("c1", "colocated", queued_prompt_tokens=2000, free_kv_blocks=100, block_size=16,
                        step_model=MODEL, chunk_tokens=512)
    assert slo_use(typical, queued) == pytest.approx((4 * 0.020 + 2.0 + 0.020 + 0.300 + 0.005) / 1.0)
    assert slo_use(typical, queued) > 2  # behind that queue the request would miss its TTFT twice over


def test_the_moving_averages_follow_the_requests_placed() -> None:
    recent = RecentRequests()
    assert recent.typical(SLO) is None
    recent.observe(100, 10)
    for _ in range(500):
        recent.observe(1000, 10)
    typical = recent.typical(SLO)
    assert typical is not None and 990 <= typical.prompt_tokens <= 1000


def test_the_gateway_exports_each_pools_summed_use_once_requests_were_placed() -> None:
    async def scenario() -> None:
        registry = WorkerRegistry(colocated=["10.0.3.1:50081", "10.0.3.2:50081"], default_slo=SLO)
        for worker, running in zip(registry.workers, (0, 6), strict=True):
            worker.serving = True
            worker.report = common_pb2.LoadReport(
                role="colocated", block_size=16, total_kv_blocks=100, free_kv_blocks=100, model_name="m",
                running_requests=running, step_model=step_model_to_proto(MODEL), max_num_batched_tokens=512)
        metrics = CollectorRegistry()
        metrics.register(PoolSloUse("m", registry.pool_slo_use))
        assert metrics.get_sample_value("tandem:pool_slo_use", {"model_name": "m", "model_version": "",
                                                                "role": "colocated"}) is None
        request = registry.route_request(list(range(300)), 100)
        registry.claim(request, Decision("10.0.3.1:50081", None, 0.3, 0.02, True, 1.0)).release()
        views = [worker.view() for worker in registry.workers]
        expected = sum(slo_use(request, view) for view in views if view is not None)
        assert metrics.get_sample_value("tandem:pool_slo_use", {"model_name": "m", "model_version": "",
                                                                "role": "colocated"}) == pytest.approx(expected)
        assert expected > 2 * slo_use(request, views[0])  # the busier worker counts for more
        await registry.close()

    asyncio.run(scenario())
