"""The links suite's KV settings: what a word of --kv-formats starts both workers with, the wire
floor a capped link puts under a transfer, and the per-setting rows compared with the baseline."""

from __future__ import annotations

import pytest

from bench.common.kv_setting import BASELINE, KVSetting, parse_settings, ratio, wire_seconds
from bench.common.links_report import setting_rows


def test_a_word_names_the_format_and_window_both_workers_start_with():
    assert KVSetting.parse("float32").worker_flags() == ["--kv-cache-dtype", "auto"]
    assert KVSetting.parse("fp8") == KVSetting("fp8_e4m3")  # vLLM's alias, as the engine reads it
    windowed = KVSetting.parse("int4+w256+s16")
    assert windowed == KVSetting("int4", 256, 16)
    assert windowed.worker_flags() == ["--kv-cache-dtype", "int4", "--kv-sliding-window", "256",
                                       "--kv-sink-tokens", "16"]
    budgeted = KVSetting.parse("float32+b512")
    assert budgeted == KVSetting("float32", budget=512)
    assert budgeted.worker_flags() == ["--kv-cache-dtype", "auto", "--kv-budget-tokens", "512"]
    assert [KVSetting.parse(s.label) for s in (windowed, KVSetting("int8", 64), BASELINE, budgeted)] == \
        [windowed, KVSetting("int8", 64), BASELINE, budgeted]


@pytest.mark.parametrize("text", ["bfloat16", "int4+s16", "int4+w0", "int8,int8", " , ", "int5",
                                  "float32+b0", "float32+w256+b512"])
def test_a_setting_the_workers_cannot_take_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match="--kv-formats"):
        parse_settings(text)


def test_the_model_dtype_names_the_baseline_of_workers_at_any_dtype():
    # The goodput suite's workers run at --dtype auto: bfloat16 on a CPU with AMX-BF16 or AVX512-BF16.
    bf16 = KVSetting.parse("bfloat16", "bfloat16")
    assert bf16 == KVSetting.parse("auto", "bfloat16") == KVSetting("bfloat16", model_dtype="bfloat16")
    assert bf16.worker_flags() == ["--kv-cache-dtype", "auto"]
    assert KVSetting.parse("bfloat16+b1024", "bfloat16").worker_flags() == ["--kv-cache-dtype", "auto",
                                                                            "--kv-budget-tokens", "1024"]
    assert [s.label for s in parse_settings("bfloat16,fp8,int8+w512+s16", "bfloat16")] == \
        ["bfloat16", "fp8_e4m3", "int8+w512+s16"]
    with pytest.raises(ValueError, match=r"--kv-formats: 'float32' is neither the workers' dtype \(bfloat16\)"):
        parse_settings("float32,int8", "bfloat16")


def test_a_tokens_kv_bytes_are_its_formats_on_the_shipped_model():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; K and V. int8 and fp8 rows carry a 4-byte scale.
    per_element = 2 * 30 * 3 * 64
    assert KVSetting.parse("float32").bytes_per_token(None) == per_element * 4
    assert KVSetting.parse("bfloat16", "bfloat16").bytes_per_token(None) == per_element * 2
    int8 = 2 * 30 * 3 * (64 + 4)
    assert KVSetting.parse("int8", "bfloat16").bytes_per_token(None) == int8
    assert KVSetting.parse("fp8+w512+s16", "bfloat16").bytes_per_token(None) == int8  # a window caps tokens, not bytes


def test_the_wire_floor_is_the_bytes_at_the_links_rate():
    # SmolLM2-135M's fp32 KV, 46,080 B a token, 1024 tokens at 200 Mbit/s = 25 MB/s.
    assert wire_seconds(46_080 * 1024, "200mbit") == pytest.approx(46_080 * 1024 / 25e6)
    assert wire_seconds(8_640, "1gbit") == pytest.approx(8_640 / 125e6)
    assert ratio(2.0, 4.0) == 0.5 and ratio(None, 4.0) is None and ratio(2.0, 0.0) is None


def _figures(bytes_per_token: float, transfer_s: float, ttft_s: float) -> dict:
    return {"kv_bytes_per_token": bytes_per_token, "transfer_alone_s": transfer_s, "ttft_s": ttft_s,
            "delivery_wait_s": None, "wire_s": None, "hidden": None}


def test_each_setting_is_compared_with_the_first_on_the_same_link_and_size():
    by_setting = {
        "float32": {"200mbit": {"requests": {256: _figures(46_080, 0.5, 1.0), 1024: _figures(46_080, 2.0, 3.0)}}},
        "int4": {"200mbit": {"requests": {256: _figures(8_640, 0.1, 0.5), 1024: _figures(8_640, 0.4, 1.5)}}},
    }
    rows = {(row["kv"], row["prompt"]): row for row in setting_rows(by_setting)}
    assert len(rows) == 4
    assert rows["float32", 1024]["vs"] == {"kv_bytes_per_token": 1.0, "transfer_alone_s": 1.0, "ttft_s": 1.0}
    assert rows["int4", 1024]["vs"] == pytest.approx({"kv_bytes_per_token": 0.1875, "transfer_alone_s": 0.2,
                                                      "ttft_s": 0.5})
    assert rows["int4", 256]["vs"]["ttft_s"] == pytest.approx(0.5)
