"""Goodput's counters as one request's flow leaves them: at the gateway (RequestObservation over
GatewayMetrics) a request that met both objectives, one that met TTFT only and one refused; at a
decode worker (DecodeRecorder over WorkerMetrics) one admitted that met or missed its TPOT objective
and one refused for KV room."""

from __future__ import annotations

import pytest

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from services.common.chunk import Chunk, Timings, Usage
from services.common.failure import Failure, WorkerError
from services.common.worker_metrics import WorkerMetrics
from services.decode.progress import DecodeStage
from services.decode.telemetry import NO_KV_ROOM, DecodeRecorder
from services.gateway.catalog import Target
from services.gateway.metrics import OBJECTIVES, REFUSAL_REASONS, GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.request import GenerateRequest, TextPrompt
from services.gateway.router import Decision, SloTargets
from services.gateway.telemetry import RequestObservation
from services.observability.metrics import RequestMetrics

HOUR = 3600.0


def _value(metrics: RequestMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "model_version": "", **labels})


def _slo(metrics: RequestMetrics) -> dict[tuple[str, str], float | None]:
    """tandem:slo_requests_total by (objective, attained), for the gateway's objectives."""
    return {(objective, attained): _value(metrics, "tandem:slo_requests_total", objective=objective,
                                          attained=attained)
            for objective in OBJECTIVES for attained in ("true", "false")}


def _outcomes(metrics: RequestMetrics) -> tuple[float | None, float | None]:
    return _value(metrics, "tandem:requests_admitted_total"), _value(metrics, "tandem:requests_served_total")


def _observation(metrics: GatewayMetrics, tokenizer) -> RequestObservation:
    observation = RequestObservation(metrics, "r1", GenerateRequest(TextPrompt("Hello"), request_id="r1"), False)
    observation.resolved(Target(ServedModel("m", 64, tokenizer), "m", "", None))
    observation.accepted(5, SamplingParams(max_tokens=3))
    return observation


def _serve(metrics: GatewayMetrics, tokenizer, slo: SloTargets) -> None:
    """One request placed against `slo` that streams three tokens and finishes."""
    observation = _observation(metrics, tokenizer)
    observation.placed({}, Decision("decode:1", None, 0.1, 0.01, True, 0.0), slo)
    observation.dispatched(0, "decode:1", "local")
    observation.streamed(Chunk("r1", (7,), "a", (), None, None, None))
    usage, timings = Usage(5, 3, 0), Timings(0.1, 0.01, 0.0, 0.05, 0.0, 0.2)
    observation.streamed(Chunk("r1", (8, 9), "bc", (), "length", usage, timings))
    observation.close()


def test_every_gateway_series_is_there_at_zero_before_any_request() -> None:
    metrics = GatewayMetrics("m")
    assert _outcomes(metrics) == (0, 0)
    assert set(_slo(metrics).values()) == {0}
    assert {reason: _value(metrics, "tandem:requests_refused_total", reason=reason) for reason in REFUSAL_REASONS} == {
        reason: 0 for reason in REFUSAL_REASONS}


def test_a_request_that_met_both_objectives_counts_toward_goodput(tokenizer) -> None:
    metrics = GatewayMetrics("m")
    _serve(metrics, tokenizer, SloTargets(HOUR, HOUR))
    assert _outcomes(metrics) == (1, 1)
    assert _slo(metrics) == {("ttft", "true"): 1, ("ttft", "false"): 0, ("tpot", "true"): 1, ("tpot", "false"): 0,
                             ("both", "true"): 1, ("both", "false"): 0}


def test_a_request_that_met_ttft_only_misses_both(tokenizer) -> None:
    metrics = GatewayMetrics("m")
    _serve(metrics, tokenizer, SloTargets(HOUR, 1e-9))  # no two tokens come a nanosecond apart
    assert _outcomes(metrics) == (1, 1)
    assert _slo(metrics) == {("ttft", "true"): 1, ("ttft", "false"): 0, ("tpot", "true"): 0, ("tpot", "false"): 1,
                             ("both", "true"): 0, ("both", "false"): 1}


def test_a_refused_request_is_neither_admitted_nor_served(tokenizer) -> None:
    metrics = GatewayMetrics("m")
    observation = _observation(metrics, tokenizer)
    observation.turned_away("queue_full")
    observation.failed("RESOURCE_EXHAUSTED", "the admission queue is full")
    observation.close()
    assert _value(metrics, "tandem:requests_refused_total", reason="queue_full") == 1
    assert _value(metrics, "tandem:request_rejections_total", code="RESOURCE_EXHAUSTED") == 1
    assert _outcomes(metrics) == (0, 0)
    assert set(_slo(metrics).values()) == {0}


def _output(tokens: int, finished: bool) -> RequestOutput:
    return RequestOutput("r1", (7,), "a", finished, "length" if finished else None, (), 5, 0, tokens)


def _decode(recorder: DecodeRecorder, first_at: float, last_at: float) -> None:
    """Three tokens, the first at `first_at` and the last at `last_at` (perf_counter seconds)."""
    recorder.output(_output(1, False), first_at)
    recorder.output(_output(2, False), (first_at + last_at) / 2)
    recorder.output(_output(3, True), last_at)
    recorder.trace()


@pytest.mark.parametrize(("objective_s", "attained"), [(0.2, "true"), (0.05, "false")])
def test_a_decode_worker_counts_its_tpot_against_the_objective_sent(objective_s: float, attained: str) -> None:
    metrics = WorkerMetrics("m")
    recorder = DecodeRecorder(metrics, arrived_at=0.0, tpot_objective_s=objective_s)
    recorder.progress.enter(DecodeStage.RESERVED, 0.1)  # its KV had room: admitted
    assert _outcomes(metrics) == (1, None)
    for stage in (DecodeStage.PREFILLING, DecodeStage.TRANSFERRING, DecodeStage.JOINING, DecodeStage.DECODING):
        recorder.progress.enter(stage, 0.5)
    _decode(recorder, 1.0, 1.2)  # TPOT (1.2 - 1.0) / 2 = 0.1 s
    assert _outcomes(metrics) == (1, 1)
    assert _value(metrics, "tandem:slo_requests_total", objective="tpot", attained=attained) == 1
    assert _value(metrics, "tandem:slo_requests_total", objective="ttft", attained=attained) is None


def test_a_prompt_computed_on_the_decode_worker_is_admitted_once_it_runs_and_without_an_objective_counts_none() -> None:
    metrics = WorkerMetrics("m")
    recorder = DecodeRecorder(metrics, arrived_at=0.0)
    recorder.progress.enter(DecodeStage.DECODING, 0.5)
    recorder.progress.enter(DecodeStage.DONE, 1.5)
    _decode(recorder, 1.0, 1.2)
    assert _outcomes(metrics) == (1, 1)
    assert _value(metrics, "tandem:slo_requests_total", objective="tpot", attained="true") is None


def test_a_decode_worker_without_kv_room_refuses_the_request() -> None:
    metrics = WorkerMetrics("m")
    recorder = DecodeRecorder(metrics, arrived_at=0.0, tpot_objective_s=0.1)
    recorder.failed(WorkerError(Failure.NO_ROOM, "no KV room"))
    recorder.trace()
    assert _value(metrics, "tandem:requests_refused_total", reason=NO_KV_ROOM) == 1
    assert _outcomes(metrics) == (None, None)
    # Failing later, for another reason, is no refusal.
    recorder = DecodeRecorder(metrics, arrived_at=0.0)
    recorder.progress.enter(DecodeStage.RESERVED, 0.1)
    recorder.failed(WorkerError(Failure.UNAVAILABLE, "KV transfer failed"))
    assert _value(metrics, "tandem:requests_refused_total", reason=NO_KV_ROOM) == 1
    assert _outcomes(metrics) == (1, None)
