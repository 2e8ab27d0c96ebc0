"""The stall a decoding request can absorb and still meet its mean-TPOT objective."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.gateway.tpot_slack import DecodeProgress


def test_before_its_first_token_a_request_has_its_whole_budget_less_its_predicted_steps() -> None:
    progress = DecodeProgress(max_tokens=65, tpot_objective_s=0.100)
    # 64 gaps of 100 ms allowed, 64 predicted steps of 60 ms: 2.56 s to spare.
    assert progress.slack_s(0.060, now=10.0) == pytest.approx(2.56)


def test_time_spent_since_the_first_token_is_taken_off() -> None:
    progress = DecodeProgress(max_tokens=65, tpot_objective_s=0.100)
    progress.delivered(1, now=10.0)
    progress.delivered(32, now=13.0)  # 33 tokens after 3 s: 32 gaps at 94 ms
    # 6.4 s allowed - 3 s spent - 32 remaining gaps x 60 ms = 1.48 s.
    assert progress.slack_s(0.060, now=13.0) == pytest.approx(1.48)
    assert progress.slack_s(0.060, now=14.0) == pytest.approx(0.48)  # a second of stall later


def test_a_request_already_over_its_objective_has_negative_slack() -> None:
    progress = DecodeProgress(max_tokens=11, tpot_objective_s=0.100)
    progress.delivered(1, now=0.0)
    progress.delivered(5, now=1.0)
    assert progress.slack_s(0.100, now=1.0) < 0


def test_a_single_token_request_has_no_tpot_to_break() -> None:
    assert DecodeProgress(max_tokens=1, tpot_objective_s=0.1).slack_s(0.05, now=0.0) == math.inf


def _decode_registry(running: int):
    from tandem.v1 import common_pb2

    from services.gateway.registry import WorkerRegistry

    registry = WorkerRegistry(prefill=[], decode=["10.0.1.1:50071"])
    (decode,) = registry.workers
    decode.serving = True
    decode.report = common_pb2.LoadReport(role="decode", running_requests=running, total_kv_blocks=1000,
                                          free_kv_blocks=1000, block_size=16)
    return registry, decode


def test_a_decode_worker_offers_the_least_slack_of_the_requests_it_streams_for_this_gateway() -> None:
    async def scenario() -> None:
        registry, decode = _decode_registry(running=0)
        assert decode.view().tpot_slack_s == math.inf  # nothing decoding: nothing to disturb
        request = registry.route_request(list(range(100)), max_tokens=65)
        placement = registry.claim(request, registry.decide(request))
        decode.report.running_requests = 1  # the worker's next report shows it
        placement.delivered(1)
        slack = decode.view().tpot_slack_s
        assert 0 < slack <= 64 * request.slo.tpot_s  # unmeasured step model: no predicted step time
        placement.release()
        decode.report.running_requests = 0
        assert decode.view().tpot_slack_s == math.inf
        await registry.close()

    asyncio.run(scenario())


def test_a_decode_worker_running_requests_of_another_gateway_offers_no_slack() -> None:
    async def scenario() -> None:
        registry, decode = _decode_registry(running=3)
        request = registry.route_request(list(range(100)), max_tokens=65)
        placement = registry.claim(request, registry.decide(request))
        assert decode.view().tpot_slack_s == 0.0  # 3 running, 1 of them ours
        placement.release()
        await registry.close()

    asyncio.run(scenario())
