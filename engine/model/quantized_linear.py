"""The matrix-product and embedding kinds over a QuantizedWeight (weight-only: activations stay in their dtype).

`QuantizedLinear` runs a plan resolved at load (engine.model.product_plan): for each band of input
rows, the kernel that computes it and the copy of the weight that kernel reads, every copy made when
the product is built. The copies:

- the packed groups (engine.model.kernels.packing.PackedWeight), always: the kernels' product over
  them (qmatmul) serves the smallest inputs, which are bound by the weight's bytes. Each weight it
  multiplies is fl(scale·q), the first rounding of QuantizedWeight.dequantize(); the offset enters as
  offset·Σx over the group. So for formats without an offset (Q8_0, round-to-nearest int8) it uses
  exactly the dequantized weights; with an offset (Q4_1) the exact value scale·q + offset, of which
  the dequantized weight is the fp32 rounding (GGUF's fp16 d makes d·q exact in fp32).
- none, for prompt-sized inputs in fp32: the weight is dequantized per call (bit for bit
  QuantizedWeight.dequantize() for the formats above) and goes through F.linear, so no dense copy is
  held between calls.
- an fp16 copy of the dequantized weight (`--cpu-weights fp16`; each weight moved by at most 2⁻¹¹ of
  itself) for fbgemm's fp16 product, which from a few rows on computes several times the kernel's
  FLOPs. torch runs fbgemm's product on one thread, so the copy is packed in pieces of rows that the
  kernels' `fp16_pieces` op spreads over torch's threads: one piece per thread, or pieces of
  `FP16_PIECE_ROWS` for a weight of more than twice that (fbgemm over a whole LM head at once is
  slower than in pieces). Made at load: any decode batch of a few rows or prompt chunk takes it, and
  packing it on that first step's path delays the step.
- with bf16 activations, a bf16 copy of the dequantized weight (about three times the model's 4-bit
  bytes), so that products no longer dequantize per call: packed for oneDNN (as vLLM's CPU build packs
  its weights; plain F.linear re-lays the weight out on every call), whose GEMM runs on AMX tiles where
  the CPU has them; on AVX512-BF16 without AMX also packed as pairs for the kernels' own bf16 GEMM
  (bf16_gemm.cpp), which prefetches the weight ahead of the rows and on the FMA variant serves every
  row count, so then no oneDNN copy is made (engine.model.kernels.bf16_choice). Its fp32 output (the
  LM head's logits) is the accumulators', not a bf16 rounding widened.
- with int8 activations (`--activation-quantization`), the values as bytes or nibbles for the int8
  GEMM (engine.model.int8_activations); no bf16 copy then.

Measurements behind the bands: `python -m bench weight_formats` and docs/benchmarks.md ("Decisions
settled by experiments").

`QuantizedEmbedding` dequantizes just the rows a step looks up, with dequantize()'s arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.int8_activations import Int8Product
from engine.model.kernels import Kernels, kernels
from engine.model.kernels.packing import BLOCK_ROWS, PackedWeight, pack_bf16_pairs
from engine.model.product_plan import ProductPlan
from engine.model.quantized import QuantizedWeight

FP16_PIECE_ROWS = 2048  # a weight of more than twice this many rows has its fp16 copy in pieces of this many
Run = Callable[[torch.Tensor, torch.dtype], torch.Tensor]  # (x in q's column order, output dtype) -> y


class QuantizedLinear:
    """y = x·Wᵀ (+ b) over a QuantizedWeight, each input through its band of `plan`."""

    def __init__(self, weight: QuantizedWeight, plan: ProductPlan, bias: torch.Tensor | None = None,
                 ops: Kernels | None = None) -> None:
        """Make every copy of the weight `plan` reads, for `ops`' kernels (None: this CPU's best build);
        ValueError where the plan's int8 GEMM is not in this build or the weight's groups do not fit it."""
        self.source = weight
        self.plan = plan
        self.weight = PackedWeight.pack(weight)
        self.bias = bias
        self.bias32 = None if bias is None else bias.float().contiguous()  # the kernels' bias
        self._ops = kernels() if ops is None else ops
        used = plan.kernels()
        self.int8 = Int8Product(weight, self.bias32, self._ops, plan.int8_parts) if "int8_gemm" in used else None
        self._fp16: list[torch.Tensor] = []  # fbgemm-packed pieces of the fp16 copy
        self._fp16_rows: list[int] = []
        if "fp16_pieces" in used:
            dense = self.dequantize()
            pieces = _pieces(dense.shape[0], torch.get_num_threads())
            # packing rounds each weight to the nearest fp16
            self._fp16 = [torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(dense[first : first + rows].contiguous())
                          for first, rows in pieces]
            self._fp16_rows = [rows for _, rows in pieces]
        self._bf16: torch.Tensor | None = None  # the dequantized weight in bf16 (oneDNN-packed for onednn_bf16)
        self._bf16_bias: torch.Tensor | None = None  # the bias in bf16, with it
        self._pairs: torch.Tensor | None = None  # the bf16 copy packed as pairs for the kernels' GEMM
        self._bf16_gemm = None
        bf16_gemms = used & {"bf16_gemm_vdpbf16ps", "bf16_gemm_fma"}
        if bf16_gemms or used & {"onednn_bf16", "linear"}:
            dense = self.dequantize().to(torch.bfloat16)
            self._bf16_bias = None if bias is None else bias.to(torch.bfloat16)
            if bf16_gemms:
                chosen = self._ops.bf16_products
                assert chosen is not None and {f"bf16_gemm_{chosen.instruction}"} == bf16_gemms, "planned elsewhere"
                self._pairs, self._bf16_gemm = pack_bf16_pairs(dense), chosen.op
            if "onednn_bf16" in used:
                self._bf16 = torch.ops.mkldnn._reorder_linear_weight(dense)
            elif "linear" in used:
                self._bf16 = dense
        runs: dict[str, Run] = {
            "qmatmul": self._qmatmul, "int8_gemm": self._int8_gemm, "fp16_pieces": self._fp16_product,
            "bf16_gemm_vdpbf16ps": self._bf16_gemm_product, "bf16_gemm_fma": self._bf16_gemm_product,
            "onednn_bf16": self._onednn_bf16, "linear": self._linear_bf16, "linear_dequantized": self._dequantized,
        }
        self._routes = tuple(zip(plan.ends, [runs[band.kernel] for band in plan.bands], strict=True))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, x.dtype)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """y in fp32: in the packed-group kernel's band its own fp32 output, not rounded to x's dtype (an
        LM head's logits: in bf16, 8 bits, the best two tie exactly at some greedy steps of the shipped
        model, and greedy then picks by index); otherwise the product's output widened."""
        return self._product(x, torch.float32)

    def _product(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        perm = self.weight.perm
        if perm is not None:
            x = x.index_select(1, perm)
        rows = x.shape[0]
        for end, run in self._routes:
            if rows < end:
                return run(x, out)
        raise AssertionError("a plan's last band has no end")

    def _qmatmul(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        return self._ops.matmul(x.float().contiguous(), self.weight, self.bias32).to(out)

    def _int8_gemm(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        assert self.int8 is not None
        return self.int8(x, out == torch.float32).to(out)

    def _fp16_product(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        return self._ops.fp16_pieces(x.contiguous(), self._fp16, self.bias32, self._fp16_rows).to(out)

    def _bf16_gemm_product(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        assert self._bf16_gemm is not None
        return self._bf16_gemm(x.contiguous(), self._pairs, self.weight.rows, self.bias32, out == torch.float32)

    def _onednn_bf16(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._bf16, self._bf16_bias, "none", [], "")
        return y.to(out)

    def _linear_bf16(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        return F.linear(x, self._bf16, self._bf16_bias).to(out)

    def _dequantized(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        return F.linear(x, self.dequantize().to(x.dtype), self.bias).to(out)

    @property
    def ops(self) -> Kernels:
        """The kernels' build this product runs on."""
        return self._ops

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K], columns in q's order (act-order weights: not input-feature order)."""
        return self._ops.dequantize(self.weight)


def _pieces(rows: int, threads: int) -> list[tuple[int, int]]:
    """(first row, rows) of each piece of an fp16 copy: one per thread (rows in multiples of 8), or
    pieces of FP16_PIECE_ROWS for a weight of more than twice that."""
    if rows > 2 * FP16_PIECE_ROWS:
        size = FP16_PIECE_ROWS
    else:
        per_thread = -(-rows // max(threads, 1))
        size = -(-per_thread // BLOCK_ROWS) * BLOCK_ROWS
    return [(first, min(size, rows - first)) for first in range(0, rows, size)]


class QuantizedEmbedding:
    """Row lookup in a QuantizedWeight [vocab, hidden], dequantizing only the rows asked for."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        if weight.perm is not None:
            raise ValueError("perm: an embedding's columns are not permuted")
        self.weight = weight
        self.dtype = dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows, cols = ids.shape[0], w.shape[1]
        values = w.q[ids].view(rows, cols // w.group_size, w.group_size).float() * w.scale[ids].unsqueeze(-1)
        if w.offset is not None:
            values = values + w.offset[ids].unsqueeze(-1)
        return values.view(rows, cols).to(self.dtype)


class DenseEmbedding:
    """Row lookup in a float weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
