"""Protobuf <-> engine conversions at the edge of the gRPC handlers."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from tandem.v1 import common_pb2, prefill_pb2

from engine.formats import EngineFormats
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.kv_cache.kv_events import KVEvents
from engine.outputs import EngineStats, RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from services.common.chunk import Timings
from services.common.convert import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    kept_blocks_from_proto,
    kv_budget_from_proto,
    kv_budget_to_proto,
    load_report,
    sampling_params_from_proto,
    sampling_params_to_proto,
    step_model_from_proto,
    step_model_to_proto,
    timings_from_proto,
    timings_to_proto,
    token_chunk,
)
from services.common.step_model import StepModel
from services.common.worker import WorkerLoad

FORMATS = EngineFormats(hardware='CPU "Xeon" [amx_bf16]', dtype="bfloat16", dtype_reason="auto", quantization="none",
                        cpu_weights="plain", kv_cache_dtype="bfloat16")


def test_an_empty_proto_means_the_engine_defaults():
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()


def test_unset_optionals_take_defaults_but_explicit_zeros_are_kept():
    unset = sampling_params_from_proto(common_pb2.SamplingParams())
    assert (unset.temperature, unset.top_p, unset.seed, unset.logprobs, unset.skip_special_tokens) == (
        1.0, 1.0, None, None, True)
    explicit = sampling_params_from_proto(
        common_pb2.SamplingParams(temperature=0.0, seed=0, logprobs=0, skip_special_tokens=False)
    )
    assert explicit.greedy
    assert (explicit.seed, explicit.logprobs, explicit.skip_special_tokens) == (0, 0, False)


def test_max_tokens_zero_means_sixteen():
    assert sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=0)).max_tokens == 16
    assert sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=5)).max_tokens == 5


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        sampling_params_from_proto(common_pb2.SamplingParams(**fields))


def test_engine_params_survive_a_round_trip():
    params = SamplingParams(
        max_tokens=7, min_tokens=2, temperature=0.5, top_k=40, top_p=0.75, min_p=0.125, repetition_penalty=1.25,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=123, stop=("\n\n", "END"), stop_token_ids=(2, 3),
        ignore_eos=True, logprobs=3, skip_special_tokens=False, logit_bias=((3, 0.5), (7, -100.0)),
        prediction=(5, 9, 5), cache_salt="tenant-a",
    )
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    greedy = SamplingParams(temperature=0.0)
    assert sampling_params_from_proto(sampling_params_to_proto(greedy)) == greedy


@pytest.mark.parametrize("spec", [
    StructuredOutput("json", '{"type": "object"}'), StructuredOutput("json_object", whitespace_flexible=False),
    StructuredOutput("regex", "[a-z]+"), StructuredOutput.choice(["yes", "no"]),
    StructuredOutput("grammar", 'start: "x"'),
    StructuredOutput("structural_tag", '{"structures": [], "triggers": []}'),
])
def test_a_structured_output_crosses_the_wire_whole(spec):
    params = SamplingParams(structured=spec)
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    with pytest.raises(ValueError, match=r"sampling\.structured: set, but with no kind"):
        sampling_params_from_proto(common_pb2.SamplingParams(structured=common_pb2.StructuredOutput()))


def _output(**overrides) -> RequestOutput:
    fields = dict(
        request_id="r", new_token_ids=(11,), new_text="hi", finished=False, finish_reason=None, logprobs=(),
        num_prompt_tokens=5, num_cached_tokens=0, num_output_tokens=1,
    )
    return RequestOutput(**(fields | overrides))


def test_an_unfinished_output_is_a_chunk_without_finish_or_usage():
    chunk = token_chunk(_output(), Timings(ttft_s=1.0))
    assert list(chunk.token_ids) == [11] and chunk.text == "hi"
    assert chunk.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert not chunk.HasField("usage") and not chunk.HasField("timings")


def test_the_final_output_carries_finish_reason_usage_timings_and_logprobs():
    logprobs = TokenLogprobs(token_id=12, logprob=-0.5, top=((12, -0.5), (13, -1.5)))
    output = _output(new_token_ids=(12,), finished=True, finish_reason="length", logprobs=(logprobs,),
                     num_cached_tokens=16, num_output_tokens=4)
    chunk = token_chunk(output, Timings(ttft_s=0.25, e2e_s=1.5))
    assert chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.cached_tokens) == (5, 4, 16)
    assert (chunk.timings.ttft_s, chunk.timings.e2e_s) == (0.25, 1.5)
    [lp] = chunk.logprobs
    assert (lp.token_id, lp.logprob) == (12, -0.5)
    assert [(t.token_id, t.logprob) for t in lp.top] == [(12, -0.5), (13, -1.5)]


@pytest.mark.parametrize(
    ("reason", "value"),
    [
        ("stop", common_pb2.FINISH_REASON_STOP),
        ("length", common_pb2.FINISH_REASON_LENGTH),
        ("abort", common_pb2.FINISH_REASON_ABORT),
        ("handoff", common_pb2.FINISH_REASON_UNSPECIFIED),
        (None, common_pb2.FINISH_REASON_UNSPECIFIED),
    ],
)
def test_finish_reasons(reason, value):
    assert finish_reason_to_proto(reason) == value
    if reason != "handoff":
        assert finish_reason_from_proto(value) == reason


def test_load_report_counts_used_blocks_from_usage():
    stats = EngineStats(num_running=2, num_waiting=1, num_waiting_tokens=300, num_free_blocks=7,
                        num_total_blocks=10, num_cached_blocks=4, kv_usage=0.3, block_size=16,
                        max_num_batched_tokens=512)
    report = load_report(WorkerLoad(worker_id="decode@x:1", role="decode", stats=stats, prefill_tokens_per_s=1000.0,
                                    decode_step_s=0.02, step_model=StepModel(), reserved_requests=1,
                                    finished_requests=9, kv_delivery_wait_s=0.0, formats=FORMATS,
                                    tensor_parallel_size=3, expert_parallel_size=3, prefill_context_parallel_size=1,
                                    pipeline_parallel_size=2,
                                    model_name="smollm2", model_version="q4",
                                    kv_layout="smollm2:ab|30|3|64|bfloat16|16"))
    assert report.used_kv_blocks == 3  # 0.3 * 10 is 2.9999...: rounded, not truncated
    assert (report.free_kv_blocks, report.total_kv_blocks, report.cached_kv_blocks) == (7, 10, 4)
    assert (report.queued_prompt_tokens, report.running_requests, report.waiting_requests) == (300, 2, 1)
    assert (report.reserved_requests, report.finished_requests, report.block_size) == (1, 9, 16)
    assert (report.prefill_tokens_per_s, report.tpot_s) == (1000.0, 0.02)
    assert (report.worker_id, report.role) == ("decode@x:1", "decode")
    assert (report.dtype, report.quantization, report.cpu_weights, report.kv_cache_dtype) == (
        "bfloat16", "none", "plain", "bfloat16")
    assert (report.tensor_parallel_size, report.expert_parallel_size, report.prefill_context_parallel_size) == (3, 3, 1)
    assert (report.model_name, report.model_version) == ("smollm2", "q4")
    assert report.kv_layout == "smollm2:ab|30|3|64|bfloat16|16"


def test_load_report_carries_a_streams_block_events_and_what_checks_them():
    stats = EngineStats(num_running=0, num_waiting=0, num_waiting_tokens=0, num_free_blocks=10, num_total_blocks=10,
                        num_cached_blocks=0, kv_usage=0.0, block_size=16, max_num_batched_tokens=512)
    load = WorkerLoad(worker_id="colocated@x:1", role="colocated", stats=stats, prefill_tokens_per_s=0.0,
                      decode_step_s=0.0, step_model=StepModel(), reserved_requests=0, finished_requests=0,
                      kv_delivery_wait_s=0.0, formats=FORMATS, tensor_parallel_size=1, expert_parallel_size=1,
                      prefill_context_parallel_size=1, pipeline_parallel_size=1, model_name="m", model_version="",
                      kv_layout="", block_hash_salt=b"salt", probe_block_hashes=(b"p" * 32,),
                      kv_load_s_per_block={"host": 0.001}, host_tier_id="node-1", kv_events_seq=7)
    events = KVEvents()
    events.stored("device", [b"a" * 32, b"b" * 32])
    events.removed("device", [b"a" * 32])
    first = events.read(None)
    report = load_report(load, first)
    assert report.kv_events_reset and report.kv_events_seq == 2
    assert [(e.tier, e.stored, list(e.block_hashes)) for e in report.kv_events] == [("device", True, [b"b" * 32])]
    events.stored("disk", [b"c" * 32])
    report = load_report(load, events.read(first.cursor))
    assert not report.kv_events_reset and report.kv_events_seq == 3
    assert [(e.tier, e.stored, list(e.block_hashes)) for e in report.kv_events] == [("disk", True, [b"c" * 32])]
    assert (report.block_hash_salt, list(report.probe_block_hashes)) == (b"salt", [b"p" * 32])
    assert (dict(report.kv_load_s_per_block), report.host_tier_id) == ({"host": 0.001}, "node-1")
    single = load_report(load)  # GetLoad: no stream, no events; the count so far
    assert not single.kv_events and not single.kv_events_reset and single.kv_events_seq == 7


def test_convert_and_server_import_no_torch():
    # The gateway uses them and must never import torch.
    code = "import sys, services.common.convert, services.common.server; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_relayed_chunk_survives_the_round_trip_through_plain_data():
    from services.common.convert import chunk_from_proto, chunk_to_proto

    middle = common_pb2.TokenChunk(
        token_ids=[5, 6], text="hi",
        logprobs=[common_pb2.TokenLogprob(token_id=5, logprob=-0.5,
                                          top=[common_pb2.TopLogprob(token_id=5, logprob=-0.5)])],
    )
    last = common_pb2.TokenChunk(
        token_ids=[7], text="!", finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=1),
        timings=common_pb2.Timings(ttft_s=0.5, tpot_s=0.25, e2e_s=1.0),
    )
    for message in (middle, last):
        chunk = chunk_from_proto(message, "r1")
        assert chunk.request_id == "r1"
        assert chunk_to_proto(chunk) == message
    assert chunk_from_proto(middle, "r1").finish_reason is None
    assert chunk_from_proto(middle, "r1").usage is None
    assert chunk_from_proto(last, "r1").usage.cached_tokens == 1


def test_the_timings_record_and_its_proto_have_the_same_fields():
    # convert.py maps them by name: a timing added to one and not the other must fail here.
    record = [field.name for field in dataclasses.fields(Timings)]
    assert record == [field.name for field in common_pb2.Timings.DESCRIPTOR.fields]
    timings = Timings(*(0.5 + i for i in range(len(record))))
    assert timings_from_proto(timings_to_proto(timings)) == timings


def test_step_model_round_trips_with_its_speculation_figures():
    model = StepModel(0.05, 0.004, 0.002, 1e-5, draft_rows_per_sequence=3.5, tokens_per_decode_step=2.25,
                      speculation_max_batch=4)
    assert step_model_from_proto(step_model_to_proto(model)) == model
    # A report from a worker that predates speculation: one token a step.
    old = step_model_to_proto(StepModel(0.05))
    old.ClearField("tokens_per_decode_step")
    assert step_model_from_proto(old).tokens_per_decode_step == 1.0


def test_a_kv_budget_crosses_the_wire_whole_and_a_bad_one_is_refused_naming_it():
    budget = KVBudget(64, 16, 16, observation_tokens=8)
    assert kv_budget_from_proto(kv_budget_to_proto(budget), 16) == budget
    with pytest.raises(ValueError, match=r"^kv_budget: kv_budget_recent_tokens: must be at least 1"):
        kv_budget_from_proto(prefill_pb2.KVBudget(tokens=64, observation_tokens=8), 16)
    with pytest.raises(ValueError, match=r"^kv_budget: kv_budget_tokens: 32 leaves no block to choose"):
        kv_budget_from_proto(prefill_pb2.KVBudget(tokens=32, recent_tokens=16, observation_tokens=8), 16)


def test_kept_blocks_come_back_with_their_scores_and_none_when_a_worker_named_none():
    response = prefill_pb2.PrefillResponse(kept_blocks=[0, 3, 4], kept_scores=[2.5, 0.125, 1e-9])
    assert kept_blocks_from_proto(response) == KeptBlocks((0, 3, 4), (2.5, 0.125, 1e-9))
    assert kept_blocks_from_proto(prefill_pb2.PrefillResponse(first_token_id=3)) is None
