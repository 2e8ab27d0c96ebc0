"""GPU figures through NVML (nvidia-ml-py), read in-process when scraped; never via `nvidia-smi`.

Without NVML (no driver, no GPU) `gpu_collector` logs one line and returns None: the process then
exports no GPU metrics at all, rather than zeros that would read as idle GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from services.observability.metrics import per_model

log = logging.getLogger(__name__)

_LABELS = per_model(["gpu"])


class GpuCollector:
    """Per-device utilisation, memory bandwidth utilisation, memory used/total and power."""

    def __init__(self, nvml: Any, model: tuple[str, str]) -> None:
        """`nvml` is the initialised `pynvml` module; `model` the name and version the worker serves."""
        self._nvml = nvml
        self._model = model
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    @property
    def num_devices(self) -> int:
        """GPUs NVML sees."""
        return len(self._handles)

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(name, documentation, labels=_LABELS)
            for name, documentation in (
                ("tandem:gpu_utilization_ratio", "Fraction of the last sample period a kernel ran on the GPU."),
                ("tandem:gpu_memory_bandwidth_utilization_ratio",
                 "Fraction of the last sample period device memory was read or written."),
                ("tandem:gpu_memory_used_bytes", "Device memory in use."),
                ("tandem:gpu_memory_total_bytes", "Device memory installed."),
                ("tandem:gpu_power_watts", "Power drawn by the device."),
            )
        }
        for index, handle in enumerate(self._handles):
            labels = [*self._model, str(index)]
            rates = self._read(self._nvml.nvmlDeviceGetUtilizationRates, handle)
            if rates is not None:
                families["tandem:gpu_utilization_ratio"].add_metric(labels, rates.gpu / 100)
                families["tandem:gpu_memory_bandwidth_utilization_ratio"].add_metric(labels, rates.memory / 100)
            memory = self._read(self._nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                families["tandem:gpu_memory_used_bytes"].add_metric(labels, memory.used)
                families["tandem:gpu_memory_total_bytes"].add_metric(labels, memory.total)
            milliwatts = self._read(self._nvml.nvmlDeviceGetPowerUsage, handle)
            if milliwatts is not None:
                families["tandem:gpu_power_watts"].add_metric(labels, milliwatts / 1000)
        yield from families.values()

    def _read(self, query: Callable[[Any], Any], handle: Any) -> Any:
        # A device may not support a query (e.g. power on some boards): that figure is left out.
        try:
            return query(handle)
        except self._nvml.NVMLError as error:
            log.debug("NVML %s: %s", query.__name__, error)
            return None


def gpu_collector(model: tuple[str, str]) -> GpuCollector | None:
    """A collector over every GPU NVML sees, or None (logged once) where NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        collector = GpuCollector(pynvml, model)
    except Exception as error:  # ImportError, NVMLError (no library, no driver) or a broken install
        log.info("NVML unavailable (%s: %s); no GPU metrics", type(error).__name__, error)
        return None
    if not collector.num_devices:
        log.info("NVML sees no GPU; no GPU metrics")
        return None
    return collector
