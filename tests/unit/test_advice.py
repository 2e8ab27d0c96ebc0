"""Deployment advice (services.gateway.advice, `tandem advise`): the mean-value model's predictions,
its choice between aggregated and disaggregated placement, and the command on a trace file."""

from __future__ import annotations

import json

import pytest

from services.common.step_model import StepModel
from services.gateway.advice import TraceShape, best_layout, capacity, predict, workers_needed
from services.gateway.router import SloTargets

# About a one-core worker of the shipped model: prefill 1 ms a token, a decode step 10 ms + 2 ms a sequence.
MODEL = StepModel(base_s=0.010, per_prompt_token_s=0.001, per_sequence_s=0.002, per_context_token_s=1e-6)
CHAT = TraceShape.of([(128, 32), (256, 64), (384, 96)] * 10)
LONG = TraceShape.of([(1024, 64), (2048, 128), (3072, 192)] * 10)
CHUNK = 512


def test_the_trace_shape_weighs_context_by_output_tokens():
    shape = TraceShape.of([(100, 10), (300, 30)])
    assert shape.prompt_mean == 200 and shape.output_mean == 20 and shape.prompt_p90 == 300
    assert shape.context_mean == pytest.approx((10 * 105 + 30 * 315) / 40)
    with pytest.raises(ValueError, match="no requests"):
        TraceShape.of([])


def test_an_idle_aggregated_worker_takes_a_prompt_in_its_compute_time():
    layout = predict(MODEL, CHAT, rate=1e-6, workers=1, prefilling=0, share=0.0, chunk_tokens=CHUNK)
    assert layout is not None
    assert layout.tpot_s == pytest.approx(MODEL.base_s, rel=1e-3)
    assert layout.ttft_s == pytest.approx(384 * 0.001 + MODEL.base_s, rel=1e-3)


def test_load_stretches_both_predictions_and_overload_is_refused():
    light = predict(MODEL, CHAT, 0.5, 1, 0, 0.0, CHUNK)
    heavy = predict(MODEL, CHAT, 2.0, 1, 0, 0.0, CHUNK)
    assert light is not None and heavy is not None
    assert heavy.ttft_s > light.ttft_s and heavy.tpot_s > light.tpot_s
    assert predict(MODEL, CHAT, 10.0, 1, 0, 0.0, CHUNK) is None  # 10 x 0.26 s of prompts a second
    assert predict(MODEL, CHAT, 1.0, 2, 2, 1.0, CHUNK) is None  # nobody decodes
    assert predict(MODEL, CHAT, 1.0, 2, 1, 0.0, CHUNK) is None  # a prefilling worker given no prompts


def test_more_workers_serve_more():
    objectives = SloTargets(ttft_s=2.0, tpot_s=0.1)
    rates = [capacity(MODEL, CHAT, workers, objectives, CHUNK)[0] for workers in (1, 2, 4)]
    assert 0 < rates[0] < rates[1] < rates[2]
    needed = workers_needed(MODEL, CHAT, rates[1] * 1.5, objectives, CHUNK)
    assert needed is not None and needed.workers in (3, 4)


def test_cheap_prompts_stay_aggregated():
    # Short prompts barely disturb the batch: a second worker decoding beats one that only prefills.
    layout = best_layout(MODEL, CHAT, 2.0, 2, SloTargets(2.0, 0.1), CHUNK)
    assert layout is not None and layout.prefilling == 0 and layout.disaggregated_share == 0


def test_long_prompts_under_a_strict_tpot_are_disaggregated():
    # A sequence decoding beside 2,000-token prompts is stretched past 20 ms a token by the one it
    # meets; a worker that computes them for the other keeps its steps short.
    strict = SloTargets(ttft_s=4.0, tpot_s=0.02)
    aggregated = predict(MODEL, LONG, 0.1, 2, 0, 0.0, CHUNK)
    assert aggregated is not None and aggregated.tpot_s > strict.tpot_s
    layout = best_layout(MODEL, LONG, 0.1, 2, strict, CHUNK)
    assert layout is not None and layout.prefilling == 1 and layout.disaggregated_share >= 0.5
    assert best_layout(MODEL, LONG, 0.1, 1, strict, CHUNK) is None


def test_the_command_reads_a_trace_and_prints_the_pool(tmp_path, capsys):
    from services.cli import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) + "\n"
                             for p, o in [(128, 32), (256, 64), (384, 96)] * 10))
    model = json.dumps({"base_s": 0.01, "per_prompt_token_s": 0.001, "per_sequence_s": 0.002,
                        "per_context_token_s": 1e-6})
    assert main(["advise", "--trace", str(trace), "--step-model", model, "--rate", "2"]) == 0
    assert "at 2 req/s: 2 workers: 2 decoding, 0 computing prompts" in capsys.readouterr().out
    assert main(["advise", "--trace", str(trace), "--step-model", model, "--max-workers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("req/s:") == 2 and "0% of prompts disaggregated" in out
    trace.write_text('{"prompt_tokens": 5}\n')
    assert main(["advise", "--trace", str(trace), "--step-model", model]) == 2
    assert "trace.jsonl:1: expected prompt_tokens and output_tokens" in capsys.readouterr().err
