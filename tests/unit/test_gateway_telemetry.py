"""The gateway's view of one request: its span's GenAI attributes (prompts and completions only on
opt-in), its in-flight gauges and counters. Spans go to the SDK's in-memory exporter."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.sampling_params import SamplingParams
from services.common.chunk import Chunk, Timings, Usage
from services.gateway.caller import Caller
from services.gateway.catalog import Target
from services.gateway.choices import ChoiceGroup
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.request import ChatMessage, ChatPrompt, GenerateRequest
from services.gateway.router import Decision, SloTargets
from services.gateway.telemetry import RequestObservation
from services.observability.metrics import one_two_five_buckets


def _chat() -> GenerateRequest:
    return GenerateRequest(ChatPrompt((ChatMessage("user", "Hello there"),)), request_id="r1")


def _chunk(token_ids: list[int], text: str, finish: str | None = None) -> Chunk:
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=0) if finish else None
    timings = Timings(0.1, 0.05, 0.0, 0.08, 0.001, 0.2, reserve_s=0.015, batch_join_s=0.004) if finish else None
    return Chunk("r1", tuple(token_ids), text, (), finish, usage, timings)


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "model_version": "", **labels}) or 0.0


def _target(tokenizer, name: str = "m", version: str = "") -> Target:
    return Target(ServedModel(name, 64, tokenizer), name, version, f"{name}@{version}" if version else None)


@pytest.mark.parametrize("capture", [False, True], ids=["default", "capture-content"])
def test_one_request_on_its_span_and_in_the_metrics(capture, caplog, tokenizer):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = GatewayMetrics("m")
    metrics.model_loaded(64)
    caplog.set_level(logging.INFO, logger="services.gateway.telemetry")
    with provider.get_tracer("test").start_as_current_span("request"):
        observation = RequestObservation(metrics, "r1", _chat(), capture)
        observation.resolved(_target(tokenizer))
        assert _value(metrics, "vllm:num_requests_waiting") == 1
        observation.accepted(5, SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9))
        route: dict = {}
        observation.placed(route, Decision("decode:1", "prefill:1", 0.25, 0.04, True, 0.5), SloTargets(2.0, 0.1))
        assert (route["tandem.route.placement"], route["tandem.route.predicted_ttft_s"]) == ("disaggregated", 0.25)
        observation.dispatched(0, "decode:1", "prefill:1")
        assert (_value(metrics, "vllm:num_requests_waiting"), _value(metrics, "vllm:num_requests_running")) == (0, 1)
        for chunk in (_chunk([7], "Hi"), _chunk([8, 9], " you", finish="length")):
            observation.streamed(chunk)
        observation.close()
    assert (_value(metrics, "vllm:num_requests_waiting"), _value(metrics, "vllm:num_requests_running")) == (0, 0)
    assert _value(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(metrics, "vllm:generation_tokens_total") == 3
    assert _value(metrics, "vllm:inter_token_latency_seconds_count") == 2
    assert _value(metrics, "tandem:routing_decisions_total", pool="prefill", worker="prefill:1") == 1
    assert _value(metrics, "tandem:placements_total", kind="disaggregated") == 1
    assert _value(metrics, "tandem:placements_total", kind="aggregated") == 0
    # vLLM's per-request shapes and phases: prefill is the prompt's compute plus the KV wait (0.08 + 0.001).
    assert _value(metrics, "vllm:request_prompt_tokens_bucket", le="5.0") == 1
    assert _value(metrics, "vllm:request_prompt_tokens_bucket", le="2.0") == 0
    assert _value(metrics, "vllm:request_generation_tokens_sum") == 3
    assert _value(metrics, "vllm:request_params_max_tokens_sum") == 16
    assert _value(metrics, "vllm:request_params_n_sum") == 1
    assert _value(metrics, "vllm:request_max_num_generation_tokens_sum") == 3
    assert _value(metrics, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.081)
    decode_s = _value(metrics, "vllm:request_decode_time_seconds_sum")
    assert _value(metrics, "vllm:request_inference_time_seconds_sum") == pytest.approx(0.081 + decode_s)
    assert _value(metrics, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode_s / 2)
    # The finish log line names where the request ran, so a benchmark's logs show how many prompts
    # a decode worker prefilled itself ("local"), and the router's predictions beside what happened.
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request finished ")]
    record = json.loads(line.removeprefix("request finished "))
    assert (record["decode_worker"], record["prefill_worker"], record["output_tokens"]) == ("decode:1", "prefill:1", 3)
    assert (record["predicted_ttft_s"], record["predicted_tpot_s"]) == (0.25, 0.04)
    # And TTFT's parts, so a log shows where a first token's time went beyond the prefill itself.
    assert (record["worker_ttft_s"], record["reserve_s"], record["batch_join_s"]) == (0.1, 0.015, 0.004)
    assert 0 <= record["placed_s"] <= record["ttft_s"]

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


def test_worker_routable_is_read_from_the_workers_at_each_scrape():
    metrics = GatewayMetrics("m")
    # The decode worker reports its model version; the prefill worker has not reported yet.
    workers = [("prefill", "10.0.0.1:1", True, None), ("decode", "10.0.0.2:1", False, "big@v2")]
    metrics.watch_workers(lambda: list(workers))
    assert _value(metrics, "tandem:worker_routable", role="prefill", worker="10.0.0.1:1") == 1
    assert metrics.registry.get_sample_value(
        "tandem:worker_routable", {"model_name": "big", "model_version": "v2", "role": "decode",
                                   "worker": "10.0.0.2:1"}) == 0
    workers[1] = ("decode", "10.0.0.2:1", True, "big@v2")  # its link came back
    workers.pop(0)  # a worker the gateway forgot is no longer exported
    assert _value(metrics, "tandem:worker_routable", model_name="big", model_version="v2", role="decode",
                  worker="10.0.0.2:1") == 1
    assert metrics.registry.get_sample_value(
        "tandem:worker_routable", {"model_name": "m", "model_version": "", "role": "prefill",
                                   "worker": "10.0.0.1:1"}) is None


def test_planner_recommendations_are_read_at_each_scrape_labelled_by_model_version():
    metrics = GatewayMetrics("m")
    recommended: dict[tuple[str | None, str], int | None] = {("big@v2", "prefill"): 3, ("big@v3", "prefill"): 1,
                                                             ("big@v3", "decode"): None}
    metrics.watch_planner(lambda: recommended)
    assert _value(metrics, "tandem:planner_recommended_replicas", model_name="big", model_version="v2",
                  role="prefill") == 3
    assert _value(metrics, "tandem:planner_recommended_replicas", model_name="big", model_version="v3",
                  role="prefill") == 1
    assert metrics.registry.get_sample_value("tandem:planner_recommended_replicas", {
        "model_name": "big", "model_version": "v3", "role": "decode"}) is None, "not measurable: no sample"
    # A gateway of one model: its pools carry the gateway's model name and no version.
    recommended = {(None, "decode"): 2}
    assert _value(metrics, "tandem:planner_recommended_replicas", role="decode") == 2


def test_a_request_is_charged_what_it_used_and_counted_by_its_key(tokenizer):
    metrics = GatewayMetrics("m")
    keyed = GenerateRequest(ChatPrompt((ChatMessage("user", "Hi"),)), caller=Caller("team-a"))
    # Ended before any chunk (refused, or its worker failed first): nothing used.
    refused = RequestObservation(metrics, "r1", keyed, False)
    refused.resolved(_target(tokenizer))
    refused.accepted(5, SamplingParams(max_tokens=3))
    refused.close()
    assert refused.used_tokens == 0
    # Cut off after two tokens: its prompt was computed, and two tokens generated.
    cut = RequestObservation(metrics, "r2", keyed, False)
    cut.resolved(_target(tokenizer))
    cut.accepted(5, SamplingParams(max_tokens=3))
    cut.streamed(_chunk([7, 8], "Hi"))
    cut.close()
    assert cut.used_tokens == 7
    # Finished: the last chunk's usage is the count.
    finished = RequestObservation(metrics, "r3", _chat(), False)
    finished.resolved(_target(tokenizer))
    finished.accepted(5, SamplingParams(max_tokens=3))
    for chunk in (_chunk([7], "Hi"), _chunk([8, 9], " you", finish="length")):
        finished.streamed(chunk)
    finished.close()
    assert finished.used_tokens == 8
    assert _value(metrics, "tandem:key_requests_total", key="team-a") == 2
    assert _value(metrics, "tandem:key_prompt_tokens_total", key="team-a") == 5
    assert _value(metrics, "tandem:key_generation_tokens_total", key="team-a") == 2
    assert (_value(metrics, "tandem:key_prompt_tokens_total", key=""),
            _value(metrics, "tandem:key_generation_tokens_total", key="")) == (5, 3)


def test_a_prompts_choices_are_counted_once_all_finished():
    metrics = GatewayMetrics("m")
    metrics.model_loaded(64)
    group = ChoiceGroup(metrics, 3)
    for tokens in (4, 9):
        group.finished(tokens)
    assert _value(metrics, "vllm:request_params_n_count") == 0
    group.finished(2)
    assert _value(metrics, "vllm:request_params_n_sum") == 3
    assert _value(metrics, "vllm:request_max_num_generation_tokens_sum") == 9
    assert _value(metrics, "vllm:request_params_n_bucket", le="2.0") == 0


def test_token_buckets_go_up_to_the_context_length_as_vllms():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(8192)[-3:] == (1000, 2000, 5000)


def test_a_request_is_counted_under_the_model_version_that_served_it(tokenizer):
    metrics = GatewayMetrics("m")
    metrics.model_loaded(64)
    unknown = RequestObservation(metrics, "r0", _chat(), False)
    unknown.failed("NOT_FOUND", "no such model")  # never resolved: the gateway's own labels
    unknown.close()
    observation = RequestObservation(metrics, "r1", _chat(), False)
    observation.resolved(_target(tokenizer, "smollm2", "q4"))
    assert _value(metrics, "vllm:num_requests_waiting", model_name="smollm2", model_version="q4") == 1
    observation.dispatched(0, "decode:1", "local")
    for chunk in (_chunk([7], "Hi"), _chunk([8, 9], " you", finish="length")):
        observation.streamed(chunk)
    observation.close()
    version = {"model_name": "smollm2", "model_version": "q4"}
    assert _value(metrics, "vllm:request_success_total", finished_reason="length", **version) == 1
    assert _value(metrics, "vllm:request_params_n_count", **version) == 1
    assert _value(metrics, "vllm:num_requests_running", **version) == 0
    assert _value(metrics, "vllm:request_success_total", finished_reason="length") == 0
    assert _value(metrics, "tandem:request_rejections_total", code="NOT_FOUND") == 1


def test_a_versions_series_exist_before_their_first_event():
    # A dashboard (or a test taking a baseline) reads them before any migration or request.
    metrics = GatewayMetrics("m")
    metrics.model_loaded(64)
    assert metrics.registry.get_sample_value("tandem:request_migrations_total",
                                             {"model_name": "m", "model_version": ""}) == 0
    assert metrics.registry.get_sample_value("vllm:request_prompt_tokens_count",
                                             {"model_name": "m", "model_version": ""}) == 0
    assert metrics.registry.get_sample_value("vllm:request_prefill_time_seconds_count",
                                             {"model_name": "m", "model_version": ""}) == 0
    metrics.labelled("smollm2", "q4")
    assert metrics.registry.get_sample_value("tandem:request_migrations_total",
                                             {"model_name": "smollm2", "model_version": "q4"}) == 0
