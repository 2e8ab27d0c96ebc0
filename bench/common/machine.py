"""What the machine under a benchmark is, read from /proc/cpuinfo: every recorded figure names its CPU,
and native builds of the baselines are keyed by the CPU's instruction-set flags."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The flags that decide which kernels a CPU runs (vector width, fp16/bf16/int8 arithmetic, AMX tiles).
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def _first(field: str, cpuinfo: str) -> str:
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                 if line.split(":", 1)[0].strip() == field), "")


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first processor's model name ("unknown" where /proc/cpuinfo has none)."""
    text = cpuinfo if cpuinfo is not None else CPUINFO.read_text(encoding="utf-8")
    return _first("model name", text) or "unknown"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's flags, as the kernel names them (`avx2`, `avx512_bf16`, `amx_tile`...)."""
    text = cpuinfo if cpuinfo is not None else CPUINFO.read_text(encoding="utf-8")
    return frozenset(_first("flags", text).split())


def describe() -> dict:
    """The machine as results files record it: processor, its ISA flags of note, cores, Python."""
    flags = cpu_flags()
    return {"processor": cpu_model(), "isa": [f for f in ISA_FLAGS if f in flags], "cpus": os.cpu_count(),
            "python": platform.python_version()}
