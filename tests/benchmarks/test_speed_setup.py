"""The speed suite's set-up: the workload's prompts are tokenized from the HF export, so the export is
made even when every baseline that serves it (vLLM) is skipped (it was not, and Tandem alone failed)."""

from __future__ import annotations

import pytest

from bench.suites import speed


class _Stop(Exception):
    """Ends the suite where its workload would be built."""


def test_the_export_is_made_before_the_workload_with_every_baseline_skipped(monkeypatch):
    steps: list[str] = []
    monkeypatch.setattr(speed, "ensure_export", lambda: steps.append("export"))

    def workload(args, threads):
        steps.append("workload")
        raise _Stop

    monkeypatch.setattr(speed, "_workload", workload)
    with pytest.raises(_Stop):
        speed.main(["--skip", "vllm-float32,vllm-auto,llama.cpp", "--threads", "1"])
    assert steps == ["export", "workload"]
