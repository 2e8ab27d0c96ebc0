"""The gateway's view of one request: its span's GenAI attributes (prompts and completions only on
opt-in), its in-flight gauges and counters. Spans go to the SDK's in-memory exporter."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tandem.v1 import common_pb2, gateway_pb2

from engine.sampling_params import SamplingParams
from services.gateway.metrics import GatewayMetrics
from services.gateway.telemetry import RequestObservation


def _chat() -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(request_id="r1")
    request.chat.messages.add(role="user", content="Hello there")
    return request


def _chunk(token_ids: list[int], text: str, finish: int = 0) -> common_pb2.TokenChunk:
    chunk = common_pb2.TokenChunk(token_ids=token_ids, text=text, finish_reason=finish)
    if finish:
        chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=0))
    return chunk


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


@pytest.mark.parametrize("capture", [False, True], ids=["default", "capture-content"])
def test_one_request_on_its_span_and_in_the_metrics(capture):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = GatewayMetrics("m")
    with provider.get_tracer("test").start_as_current_span("request"):
        observation = RequestObservation(metrics, "r1", _chat(), capture)
        assert _value(metrics, "vllm:num_requests_waiting") == 1
        observation.accepted(5, SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9))
        observation.dispatched(0, "decode:1", "prefill:1")
        assert (_value(metrics, "vllm:num_requests_waiting"), _value(metrics, "vllm:num_requests_running")) == (0, 1)
        for chunk in (_chunk([7], "Hi"), _chunk([8, 9], " you", finish=common_pb2.FINISH_REASON_LENGTH)):
            observation.streamed(chunk)
        observation.close()
    assert (_value(metrics, "vllm:num_requests_waiting"), _value(metrics, "vllm:num_requests_running")) == (0, 0)
    assert _value(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(metrics, "vllm:generation_tokens_total") == 3
    assert _value(metrics, "vllm:inter_token_latency_seconds_count") == 2
    assert _value(metrics, "tandem:routing_decisions_total", pool="prefill", worker="prefill:1") == 1

    [span] = exporter.get_finished_spans()
    attributes = span.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.max_tokens"] == 3 and attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert [event.name for event in span.events] == ["dispatch", "first_token", "finish"]
    if capture:
        [message] = json.loads(attributes["gen_ai.input.messages"])
        assert message["parts"][0]["content"] == "Hello there"
        [answer] = json.loads(attributes["gen_ai.output.messages"])
        assert answer["parts"][0]["content"] == "Hi you"
    else:
        assert "gen_ai.input.messages" not in attributes and "gen_ai.output.messages" not in attributes


def test_a_refused_request_leaves_the_gauges_and_marks_the_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = GatewayMetrics("m")
    with provider.get_tracer("test").start_as_current_span("request"):
        observation = RequestObservation(metrics, "r2", _chat(), capture_content=False)
        observation.failed("UNAVAILABLE", "no decode worker is serving")
        observation.close()
    assert _value(metrics, "vllm:num_requests_waiting") == 0
    assert _value(metrics, "tandem:request_rejections_total", code="UNAVAILABLE") == 1
    [span] = exporter.get_finished_spans()
    assert not span.status.is_ok and span.attributes["error.type"] == "UNAVAILABLE"
