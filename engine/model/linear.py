"""The model's matrix products over float weights, y = x·Wᵀ (+ b), prepared once for the CPU's kernels.

An fp32 decode step on CPU is bound by streaming the weights from memory, and plain `F.linear`
re-lays the weight out on every call. So the weights are prepared once at load, in one of three
formats (`EngineConfig.cpu_weights`), and each product runs its plan (engine.model.product_plan):

- "fp16": the weight is rounded to fp16 in place and packed for fbgemm's fp16-weight product,
  which reads half the bytes and computes in fp32: faster than the oneDNN-packed fp32 weight at
  decode sizes, behind MKL's GEMM from a few hundred rows up. The GGUF's own weights are 4-bit
  (Q4_1) and 8-bit (Q8_0) blocks with fp16 scales; rounding them to fp16 moves each by at most
  2⁻¹¹ of itself.
- "fp32": exact weights, pre-packed for oneDNN (what vLLM's CPU build does): faster than
  `F.linear` at decode sizes, slower at prompt sizes.
- "plain": `F.linear` only, no second copy of the weights.

Each format keeps the fp32 weight for the inputs its packed kernel does not win, so every band
computes with the same weight values (docs/benchmarks.md, "Decisions settled by experiments").

torch marks the two aten fp16 ops deprecated (each prints one warning line per process); their
replacement, `torch.ops.quantized.linear_dynamic_fp16`, is slower per decode step from per-call
overhead (docs/benchmarks.md). torch is pinned, and `plan_dense` falls back to the exact format's
kernels in a torch without them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.product_plan import ProductPlan


class Linear:
    """A product over a float weight (and bias) that the model's loader filled, run as `plan` says
    (engine.model.product_plan.plan_dense made it for this weight)."""

    def __init__(self, weight: torch.Tensor, plan: ProductPlan, bias: torch.Tensor | None = None) -> None:
        """Prepare the weight for the plan's kernels; for fbgemm's fp16 product the weight itself is
        rounded to fp16 in place, so that every band computes with the same values."""
        self.weight = weight
        self.bias = bias
        self.plan = plan
        first = plan.bands[0]
        self._packed: torch.Tensor | None = None  # the weight packed for the first band's kernel
        with torch.no_grad():
            if first.kernel == "fbgemm_fp16":
                self.weight.copy_(self.weight.half())
                self._packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(self.weight.detach())
            elif first.kernel == "onednn_fp32":
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self._packed_kernel = first.kernel
        self._packed_rows = plan.ends[0] if self._packed is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self._packed_rows:
            if self._packed_kernel == "fbgemm_fp16":
                return torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation(x, self._packed, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
