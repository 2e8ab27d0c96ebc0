"""Which of the kernels' two bf16 GEMMs serves a CPU's bf16 products, measured once at start-up.

Both multiply bf16 rows by the same weight packed as pairs (bf16_gemm.cpp), exact products of bf16
values accumulated in fp32; they differ in the instruction. `vdpbf16ps` multiplies 32 pairs an
instruction, fp32 FMAs 16 products an instruction over the pairs split into two fp32 halves. Which is
faster is not in the CPU flags (an AMD EPYC Zen 5 runs vdpbf16ps faster, an Intel Xeon with
AVX512-BF16 and no AMX its FMAs: docs/benchmarks.md, "Decisions settled by experiments"). So the engine
times both on one of the model's products, a decode batch's, and keeps the faster; the start-up log
says which, with the figures.

Where the FMA GEMM wins, it also beats oneDNN's vdpbf16ps GEMM at prompt sizes, so it serves every
row count and no oneDNN copy of the weights is made; the vdpbf16ps GEMM serves decode batches only,
prompts going to oneDNN (the rows each serves: engine.model.product_plan).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Bf16GemmOp = Callable[[torch.Tensor, torch.Tensor, int, "torch.Tensor | None", bool], torch.Tensor]

_PROBE = (32, 576, 1536)  # rows, K, N: a 32-row decode batch through the shipped model's gate/up product
_ROUNDS = 5


@dataclass(frozen=True)
class Bf16Gemm:
    """The chosen bf16 GEMM: `op(x, packed, n, bias, fp32_out)` over a weight packed by
    `engine.model.kernels.packing.pack_bf16_pairs`."""

    op: Bf16GemmOp
    instruction: str  # "vdpbf16ps" or "fma"
    gflops: tuple[float, float]  # measured: (vdpbf16ps, fma), on the probe, this process's threads


def _best_seconds(op: Bf16GemmOp, x: torch.Tensor, packed: torch.Tensor, n: int) -> float:
    best = float("inf")
    for _ in range(_ROUNDS):
        start = time.perf_counter()
        op(x, packed, n, None, False)
        best = min(best, time.perf_counter() - start)
    return best


def choose_bf16_gemm(dpbf16: Bf16GemmOp, fma: Bf16GemmOp,
                     pack: Callable[[torch.Tensor], torch.Tensor]) -> Bf16Gemm:
    """Time both GEMMs on the probe product (after one warm-up call each) and keep the faster."""
    rows, k, n = _PROBE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    packed = pack(torch.randn(n, k, generator=generator).to(torch.bfloat16))
    for op in (dpbf16, fma):
        op(x, packed, n, None, False)
    seconds = (_best_seconds(dpbf16, x, packed, n), _best_seconds(fma, x, packed, n))
    gflops = tuple(2 * rows * k * n / s / 1e9 for s in seconds)
    chosen = Bf16Gemm(fma, "fma", gflops) if seconds[1] < seconds[0] else Bf16Gemm(dpbf16, "vdpbf16ps", gflops)
    log.info("bf16 products: the kernels' %s GEMM (measured on %d×%d×%d: vdpbf16ps %.0f GFLOP/s, fp32 FMAs "
             "%.0f, %d threads)", chosen.instruction, rows, k, n, *gflops, torch.get_num_threads())
    return chosen
