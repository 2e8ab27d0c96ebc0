"""The issue-20 suites' verdicts: the better of two vLLM configurations is the one Tandem is held
against, a missing baseline gives no verdict, and a fidelity row is judged against its own row."""

from __future__ import annotations

import pytest

from bench.fidelity.formats import FORMATS, selected
from bench.fidelity.report import verdict
from bench.throughput.speed_report import verdicts


def test_tandem_is_held_against_the_better_vllm_and_llama_cpp():
    found = {v["figure"]: v for v in verdicts({
        "tandem": {"prefill_tps": 300.0, "decode_c1_tps": 40.0, "output_tps_c32": 200.0},
        "vllm-float32": {"prefill_tps": 250.0, "output_tps_c32": 120.0},
        "vllm-auto": {"prefill_tps": 100.0, "output_tps_c32": 150.0},
    }, top=32)}
    assert found["prefill_tps"]["best_baseline"] == "vllm-float32" and found["prefill_tps"]["met"]
    assert found["output_tps_c32"]["best_baseline"] == "vllm-auto"
    assert found["output_tps_c32"]["ratio"] == pytest.approx(200 / 150) and not found["output_tps_c32"]["met"]
    assert found["decode_c1_tps"]["ratio"] is None and found["decode_c1_tps"]["met"] is None  # no llama.cpp


def test_a_fidelity_row_is_judged_against_its_own_row_and_bound():
    by_name = {f.name: f for f in FORMATS}
    results = {"fp32": {"perplexity": 10.0}, "bf16": {"perplexity": 10.2}, "gguf-bf16": {"perplexity": 10.24}}
    assert verdict(by_name["bf16"], results)["verdict"] == "MISSED"  # +2% > +1%
    judged = verdict(by_name["gguf-bf16"], results)  # against bf16, not fp32
    assert judged["rise"] == pytest.approx(0.04 / 10.2) and judged["verdict"] == "met"
    assert verdict(by_name["int8"], results)["verdict"] == "-"  # not measured
    assert verdict(by_name["fp32-fp16w"], {**results, "fp32-fp16w": {"perplexity": 10.0}})["verdict"] == "reported"


def test_choosing_formats_brings_in_the_rows_they_are_held_against():
    assert [f.name for f in selected("gguf-bf16")] == ["fp32", "bf16", "gguf-bf16"]
    with pytest.raises(ValueError, match="unknown format nf4"):
        selected("nf4")
