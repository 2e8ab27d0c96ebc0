"""bench/goodput/gateway_log.py: a rate's routing figures from the gateway's log lines, in the
formats services/gateway/telemetry.py writes."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from bench.goodput.gateway_log import read_routing, summarize_routing

T0 = 1_800_000_000.0


def _at(seconds: float) -> str:
    stamp = datetime.fromtimestamp(T0 + seconds)
    return stamp.strftime("%Y-%m-%d %H:%M:%S,") + f"{stamp.microsecond // 1000:03d}"


def _finished(seconds: float, prefill: str, ttft: float, predicted: float | None) -> str:
    record = {"request_id": "cmpl-1-0", "ttft_s": ttft, "decode_worker": "127.0.0.1:2", "prefill_worker": prefill}
    if predicted is not None:
        record["predicted_ttft_s"] = predicted
    return f"{_at(seconds)} INFO services.gateway.telemetry: request finished {json.dumps(record)}"


def _refused(seconds: float) -> str:
    return (f"{_at(seconds)} INFO services.gateway.telemetry: request cmpl-9-0 failed: RESOURCE_EXHAUSTED: "
            "no worker can meet TTFT 2000 ms / TPOT 100 ms now")


def test_counts_where_prompts_ran_refusals_and_prediction_error_within_the_window():
    lines = [
        _finished(1, "127.0.0.1:1", 1.0, 0.5),  # before the window
        "tandem gateway ready grpc=127.0.0.1:3 http=127.0.0.1:4",
        _finished(11, "127.0.0.1:1", 1.0, 1.0),
        _finished(12, "127.0.0.1:1", 1.5, 1.0),
        _finished(13, "127.0.0.1:1", 3.0, 1.0),
        _finished(14, "local", 0.8, 1.0),
        _finished(15, "127.0.0.1:1", 2.0, None),  # a gateway that logged no prediction
        _refused(16),
        _refused(40),  # after the window
    ]
    summary = summarize_routing(lines, T0 + 10, T0 + 20)
    assert summary["prompts_computed"] == {"prefill_worker": 4, "local": 1}
    assert summary["refused"] == 1
    remote = summary["ttft_actual_over_predicted"]["prefill_worker"]
    assert remote["n"] == 3 and remote["p50"] == pytest.approx(1.5)
    assert remote["p10"] < 1.5 < remote["p90"] <= 3.0
    assert summary["ttft_actual_over_predicted"]["local"] == {"p10": 0.8, "p50": 0.8, "p90": 0.8, "n": 1}


def test_a_configuration_without_a_gateway_log_has_no_routing_figures(tmp_path):
    assert read_routing(str(tmp_path / "vllm-gateway.log"), T0, T0 + 1) is None
