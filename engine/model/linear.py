"""The model's matrix products, y = x·Wᵀ (+ b), over weights prepared once for the CPU's kernels.

An fp32 decode step on CPU is bound by streaming the weights from memory, and plain `F.linear`
re-lays the weight out on every call. So the weights are prepared once at load, in one of three
formats (`EngineConfig.cpu_weights`):

- "fp16": the weight is rounded to fp16 in place and packed for fbgemm's fp16-weight product,
  which reads half the bytes and computes in fp32: faster than the oneDNN-packed fp32 weight at
  decode sizes, behind MKL's GEMM from a few hundred rows up. The GGUF's own weights are 4-bit
  (Q4_1) and 8-bit (Q8_0) blocks with fp16 scales; rounding them to fp16 moves each by at most
  2⁻¹¹ of itself.
- "fp32": exact weights, pre-packed for oneDNN (what vLLM's CPU build does): faster than
  `F.linear` at decode sizes, slower from 64 rows up.
- "plain": `F.linear` only, no second copy of the weights.

fbgemm's fp16 product runs on one thread, so with more torch threads only the smallest inputs take
it (beside a multi-threaded oneDNN product it wins only there). Each format keeps the fp32 weight
for the inputs its packed kernel does not win, so every path computes with the same weight values.
The row limits below are where the kernels cross over (docs/benchmarks.md, "Weights held at fp16
for decode" and "Prompts under gguf": on an AMD EPYC with AVX2, one thread, 2026-12-01, the fp16
product stayed faster at 512 and 1,024 rows, where an earlier run had put the limit at 512, so every
prompt chunk of the default 2,048-token budget takes it).

torch marks the two aten fp16 ops deprecated (each prints one warning line per process); their
replacement, `torch.ops.quantized.linear_dynamic_fp16`, is slower per decode step from per-call
overhead (docs/benchmarks.md). torch is pinned, and `can_prepare` falls back to the exact format's
kernels in a torch without them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import CpuWeights

PACKED_MAX_ROWS = 64  # from this many rows (tokens) up, F.linear beats the oneDNN-packed weight
FP16_MAX_ROWS = 4096  # one thread: fbgemm's fp16 product measured faster than F.linear up to 2,048 rows
FP16_MAX_ROWS_THREADED = 16  # several threads: fbgemm still runs on one


class Linear:
    """A product over a weight (and bias) parameter that the model's loader fills."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self._onednn: torch.Tensor | None = None
        self._fp16: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._fp16 is not None and rows < fp16_max_rows():
            return torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation(x, self._fp16, self.bias)
        if self._onednn is not None and rows < PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def prepare(self, weights: CpuWeights) -> bool:
        """Prepare the (loaded) weight in the given format; whether that applied here (fp32 on CPU
        with the kernel built in). Rounds the weight parameter itself for "fp16"."""
        if weights == "plain" or not can_prepare(self.weight, weights):
            return False
        with torch.no_grad():
            if weights == "fp16":
                self.weight.copy_(self.weight.half())
                self._fp16 = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(self.weight.detach())
            else:
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        return True


def fp16_max_rows() -> int:
    """Inputs with fewer rows than this take the fp16 product (it runs on one thread)."""
    return FP16_MAX_ROWS if torch.get_num_threads() == 1 else FP16_MAX_ROWS_THREADED


def can_prepare(weight: torch.Tensor, weights: CpuWeights) -> bool:
    """Packed formats apply to fp32 weights on CPU, when torch was built with their kernel."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    if weights == "fp16":
        return has_fp16_product()
    return weights == "fp32" and torch.backends.mkldnn.is_available()


def has_fp16_product() -> bool:
    """Whether this torch was built with fbgemm's fp16-weight product."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.aten, "fbgemm_linear_fp16_weight_fp32_activation")
