"""The quantized-product kernels (qmatmul.cpp), loaded for the CPU at hand.

`kernels()` loads the best build this CPU runs ("avx2": AVX2 + FMA + F16C intrinsics; else
"scalar": plain C++), building it on first use if the Makefile's step has not (engine.model.kernels.build);
`kernels("scalar")` loads a given one (tests compare both). The ops take a weight already packed
by engine.model.quantized_linear.PackedWeight.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from engine.model.kernels.build import Variant, cpu_flags, library, runnable, variant_named

if TYPE_CHECKING:
    from engine.model.quantized_linear import PackedWeight


class Kernels:
    """One build's ops: the quantized product and the dequantization of a packed weight."""

    def __init__(self, variant: Variant) -> None:
        torch.ops.load_library(str(library(variant)))
        self.variant = variant
        self._ops = getattr(torch.ops, variant.namespace)

    def matmul(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x·Wᵀ (+ bias, fp32), x contiguous fp32 [M, K]: fp32 [M, N]."""
        return self._ops.matmul(x, w.packed, w.scale, w.offset, w.bits, w.group_size, w.rows, bias)

    def dequantize(self, w: PackedWeight) -> torch.Tensor:
        """The fp32 weight [N, K] (columns in q's order), fl(fl(scale·q) + offset) per element."""
        return self._ops.dequantize(w.packed, w.scale, w.offset, w.bits, w.group_size, w.rows)

    def describe(self) -> str:
        """For the start-up log: the variant and the CPU flags that chose it."""
        needs = f" (CPU flags {' '.join(self.variant.cpu_flags)})" if self.variant.cpu_flags else ""
        return f"{self.variant.name}{needs}"


@functools.cache
def kernels(name: str | None = None) -> Kernels:
    """The loaded build called `name`, or with None the best one this CPU runs. RuntimeError if it
    cannot run here or cannot be built."""
    return Kernels(runnable(cpu_flags())[0] if name is None else variant_named(name))
