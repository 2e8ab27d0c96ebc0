"""GPU metrics through NVML: absent for real on this machine, present through a fake `pynvml`.

The machine the tests run on has no GPU and no NVML library, so the NVML path runs against a fake
`pynvml` module with the functions Tandem calls; the no-NVML path runs against the real package.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.worker_metrics import WorkerMetrics
from services.observability.gpu import gpu_collector


def _samples(metrics: WorkerMetrics) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, sample.labels.get("gpu", "")): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def _nvml_present() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_present(), reason="this machine has NVML; the no-NVML path needs one without")
def test_without_nvml_one_line_and_no_gpu_metrics(caplog):
    with caplog.at_level(logging.INFO, logger="services.observability.gpu"):
        assert gpu_collector("m") is None
    [line] = caplog.records
    assert "NVML unavailable" in line.message
    metrics = WorkerMetrics("m")
    assert not any(name.startswith("tandem:gpu_") for name, _ in _samples(metrics))
    assert ("vllm:prompt_tokens_total", "") in _samples(metrics)


def _fake_pynvml() -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def power(handle: int) -> int:
        if handle == 1:
            raise NVMLError("Not Supported")
        return 151_500  # milliwatts

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 2
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=40 + handle, memory=20)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=(handle + 1) << 30, total=80 << 30)
    nvml.nvmlDeviceGetPowerUsage = power
    return nvml


def test_gpu_metrics_per_device_through_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    samples = _samples(WorkerMetrics("m"))
    assert samples[("tandem:gpu_utilization_ratio", "0")] == pytest.approx(0.40)
    assert samples[("tandem:gpu_utilization_ratio", "1")] == pytest.approx(0.41)
    assert samples[("tandem:gpu_memory_bandwidth_utilization_ratio", "1")] == pytest.approx(0.20)
    assert samples[("tandem:gpu_memory_used_bytes", "1")] == 2 << 30
    assert samples[("tandem:gpu_memory_total_bytes", "0")] == 80 << 30
    assert samples[("tandem:gpu_power_watts", "0")] == pytest.approx(151.5)
    # A query the device does not support leaves only that figure out.
    assert ("tandem:gpu_power_watts", "1") not in samples
