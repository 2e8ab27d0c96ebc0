"""What the machine computes natively, probed once at start-up: the CPU's name and instruction-set
flags (Linux's /proc/cpuinfo), or the GPU's name and compute capability.

The machine under a deployment changes (an AVX2-only EPYC one day, a Xeon with AVX-512 and AMX the
next), so every choice that depends on it (the dtype `auto` selects, engine.formats; the CPU kernels)
reads these flags rather than assuming them.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

CPUINFO = "/proc/cpuinfo"
# The flags any choice here reads, in the order the start-up line lists them.
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16")
# bf16 before compute capability 8.0 (Ampere) has no tensor-core path.
GPU_BF16_CAPABILITY = (8, 0)


def _flag(name: str) -> property:
    return property(lambda self: name in self.flags, doc=f"Whether the CPU lists `{name}`.")


@dataclass(frozen=True)
class CpuFeatures:
    """A CPU's model name and its /proc/cpuinfo flags."""

    model_name: str
    flags: frozenset[str]

    @classmethod
    def parse(cls, cpuinfo: str) -> CpuFeatures:
        """The first processor's `model name` and `flags` lines of a /proc/cpuinfo text (every
        core of one machine reports the same)."""
        fields: dict[str, str] = {}
        for line in cpuinfo.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
        return cls(fields.get("model name", "unknown CPU"), frozenset(fields.get("flags", "").split()))

    has_avx2 = _flag("avx2")
    has_fma = _flag("fma")
    has_f16c = _flag("f16c")
    has_avx512f = _flag("avx512f")
    has_avx512_bf16 = _flag("avx512_bf16")
    has_avx512_fp16 = _flag("avx512_fp16")
    has_avx512_vnni = _flag("avx512_vnni")
    has_amx_bf16 = _flag("amx_bf16")

    @property
    def bf16_instruction(self) -> str | None:
        """The flag through which this CPU multiplies bf16 natively (AMX first, the faster), or None."""
        return "amx_bf16" if self.has_amx_bf16 else "avx512_bf16" if self.has_avx512_bf16 else None

    def describe(self) -> str:
        """E.g. `CPU "AMD EPYC" [avx2 fma f16c]`: the name and which of SIMD_FLAGS it has."""
        present = " ".join(flag for flag in SIMD_FLAGS if flag in self.flags) or "none of " + " ".join(SIMD_FLAGS)
        return f'CPU "{self.model_name}" [{present}]'


@dataclass(frozen=True)
class GpuFeatures:
    """A CUDA device's name and compute capability."""

    name: str
    capability: tuple[int, int]

    @property
    def has_bf16(self) -> bool:
        return self.capability >= GPU_BF16_CAPABILITY

    def describe(self) -> str:
        """E.g. `GPU "NVIDIA H200" [sm_90]`."""
        return f'GPU "{self.name}" [sm_{self.capability[0]}{self.capability[1]}]'


Hardware = CpuFeatures | GpuFeatures


@functools.cache
def cpu_flags(path: str = CPUINFO) -> CpuFeatures:
    """This machine's CPU, read once per process. Where the file does not exist (not Linux), no
    flag is known, so every choice falls back to what any CPU computes (fp32)."""
    try:
        with open(path, encoding="utf-8") as cpuinfo:
            return CpuFeatures.parse(cpuinfo.read())
    except FileNotFoundError:
        return CpuFeatures(platform.processor() or "unknown CPU", frozenset())


def probe(device: str) -> Hardware:
    """What computes on `device` ("cpu" or "cuda[:N]")."""
    if device == "cpu":
        return cpu_flags()
    index = torch.device(device).index or 0
    capability = torch.cuda.get_device_capability(index)
    return GpuFeatures(torch.cuda.get_device_name(index), (capability[0], capability[1]))
