"""The goodput suite's --kv-formats: every Tandem configuration once per KV setting, vLLM's once,
each Tandem row's KV bytes per token and goodput against the first setting's for the same
configuration and run (bench/goodput/kv_compare.py)."""

from __future__ import annotations

import pytest

from bench.common.kv_setting import KVSetting
from bench.common.metrics import Slo
from bench.goodput.deploy import tandem_dtype
from bench.goodput.kv_compare import expand, format_kv, kv_entry
from bench.goodput.report import label
from bench.suites.goodput import _targets, parse_args

SLO = Slo("loose", ttft_s=2.0, tpot_s=0.1)
BF16, INT8 = KVSetting("bfloat16", model_dtype="bfloat16"), KVSetting("int8", model_dtype="bfloat16")


def test_each_tandem_configuration_runs_once_per_setting_and_vllm_once():
    assert expand(["colocated-wide", "vllm", "disagg"], [BF16, INT8]) == [
        ("colocated-wide:bfloat16", BF16), ("colocated-wide:int8", INT8), ("vllm", None),
        ("disagg:bfloat16", BF16), ("disagg:int8", INT8)]
    assert expand(["disagg", "vllm-auto"], None) == [("disagg", None), ("vllm-auto", None)]
    assert label("colocated-wide:int8") == "Tandem colocated, one engine on 2 cores, KV int8"
    assert label("disagg:int4+w256+s16#2") == "Tandem disaggregated, KV int4+w256+s16, run 2"


def test_every_setting_has_its_own_logs_and_is_compared_with_the_first_in_its_run():
    args = parse_args(["--configs", "colocated-wide,vllm", "--kv-formats", "auto,int8", "--repeats", "2"])
    targets = _targets(args)  # deployment() starts nothing until entered
    baseline = tandem_dtype()  # `auto`: what the workers compute in
    assert [name for name, *_ in targets] == [
        f"colocated-wide:{baseline}", "colocated-wide:int8", "vllm",
        f"colocated-wide:{baseline}#2", "colocated-wide:int8#2", "vllm#2"]
    logs = [log for _, _, log, _ in targets]
    assert logs[1].endswith("goodput-logs/kv-int8/colocated-wide-gateway.log")
    assert logs[4].endswith("goodput-logs/run2/kv-int8/colocated-wide-gateway.log")
    entries = [kv for *_, kv in targets]
    assert entries[2] is None and entries[5] is None
    assert entries[4]["setting"] == "int8" and entries[4]["baseline"] == f"colocated-wide:{baseline}#2"
    assert entries[4]["bytes_per_token"] < entries[3]["bytes_per_token"]


@pytest.mark.parametrize("argv", [["--kv-formats", "int5"], ["--kv-formats", "int8,int8"],
                                  ["--kv-formats", "int8", "--endpoint", "http://127.0.0.1:1"]])
def test_kv_formats_the_suite_cannot_run_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def _measured(goodput: float, setting: KVSetting, bytes_per_token: float, repeat: str = "") -> dict:
    return {"goodput": {SLO.name: {"interpolated": goodput, "highest_passing": goodput, "bounded": True}},
            "kv": kv_entry("disagg", setting, BF16, bytes_per_token, repeat)}


def test_the_kv_table_gives_bytes_and_goodput_against_the_baseline_of_the_same_run():
    configs = {"disagg:bfloat16": _measured(2.0, BF16, 23_040), "disagg:int8": _measured(1.5, INT8, 12_240),
               "vllm": {"goodput": {SLO.name: {"interpolated": 9.0}}},
               "disagg:bfloat16#2": {"skipped": "no port", "kv": kv_entry("disagg", BF16, BF16, 23_040, "#2")},
               "disagg:int8#2": _measured(1.0, INT8, 12_240, "#2")}
    lines = format_kv(configs, [SLO]).splitlines()
    assert "| Tandem disaggregated, KV bfloat16 | 23,040 | 1.00x | 2.00 | 1.00x |" in lines
    assert "| Tandem disaggregated, KV int8 | 12,240 | 0.53x | 1.50 | 0.75x |" in lines
    # Its baseline was skipped: no goodput to compare with, but the bytes are computed, not measured.
    assert "| Tandem disaggregated, KV int8, run 2 | 12,240 | 0.53x | 1.00 | - |" in lines
    assert not any("vLLM" in line for line in lines) and len(lines) == 5
