"""The CPU kernels, loaded for the CPU at hand: the quantized products (qmatmul.cpp), fbgemm's fp16 product
with a weight's pieces on several threads (fp16_pieces.cpp), the ops that cost a batch-1 decode step
most outside them in torch (rms_norm.cpp, decode_attention.cpp, rotary.cpp, silu_mul.cpp), LoRA's
products by adapter slot (lora_bgmv.cpp), greedy decoding's argmax over the vocabulary (argmax.cpp), all
of a small decode batch's decoder layers as one call (decode_stack.cpp), and, in the avx512bf16 build
only, a bf16 prompt chunk's causal attention (prefill_attention.cpp), the bf16 product over a weight
packed as pairs (bf16_gemm.cpp) and the product of integer groups with int8-quantized activations
(int8_gemm.cpp).

`kernels()` loads the best build this CPU runs ("avx512bf16": the AVX2 code with AVX-512's registers
plus the AVX512-BF16 ops; else "avx2": AVX2 + FMA + F16C intrinsics; else "scalar": plain C++),
building it on first use if the Makefile's step has not (engine.model.kernels.build);
`kernels("scalar")` loads a given one (tests compare both). The ops take weights already packed in
the layouts of engine.model.kernels.packing. `cpu_kernels(device)` is what the model and the
attention backend use: the best build on a CPU device, None elsewhere or where none can be built.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from engine.model.kernels.bf16_choice import Bf16Gemm, Bf16GemmOp, choose_bf16_gemm
from engine.model.kernels.build import Variant, cpu_flags, library, runnable, variant_named
from engine.model.kernels.packing import PackedWeight, pack_bf16_pairs

log = logging.getLogger(__name__)

# The activation dtypes the ops other than the products take (those compute in fp32 inside).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class Kernels:
    """One build's ops: the quantized product and the dequantization of a packed weight, the fp16
    product in pieces, RMSNorm and paged decode attention, rotary embedding and SwiGLU's
    silu(gate)·up (fp32; all but the products take bf16 too)."""

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

    def fp16_pieces(self, x: torch.Tensor, packed: list[torch.Tensor], bias: torch.Tensor | None,
                    rows: list[int]) -> torch.Tensor:
        """y = x·Wᵀ (+ bias) through fbgemm's fp16 product, W's rows in pieces (`rows[i]` rows packed
        by fbgemm_pack_gemm_matrix_fp16 as `packed[i]`) spread over torch's threads: fp32 [M, Σ rows]."""
        return self._ops.fp16_pieces(x, packed, bias, rows)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of fp32 or bf16 x [..., n] by the weight [n] of its dtype, in transformers' arithmetic
        (for bf16: normalised in fp32, rounded, times the weight, rounded)."""
        return self._ops.rms_norm(x, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x fp32 or bf16 [T, heads, head_dim] (rows contiguous) rotated in place by cos, sin
        [T, 1, head_dim // 2] of its dtype and returned: bit for bit what engine.model.rope.apply_rotary
        returns."""
        return self._ops.rotary_(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up for fp32 or bf16 gate_up [T, 2I] (gate | up, rows contiguous): [T, I] in its
        dtype (bf16 rounded where torch's bf16 ops round)."""
        return self._ops.silu_mul(gate_up)

    def lora_add_(self, y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
                  columns: list[int], order: torch.Tensor, segments: torch.Tensor, ranks: list[int]) -> None:
        """y fp32 or bf16 [T, n] += each LoRA module's term (x·A_s)·B_s for the rows of each slot s: the
        rows `order` (int64) grouped by slot, `segments` int64 [G, 3] (slot, begin, end in `order`);
        x [T, in] and the modules' A [in, slots, width] and B [slots, width, out] of one dtype (fp32 or
        bf16), each module adding to y's columns from `columns[k]`; `ranks`: each slot's (lora_bgmv.cpp)."""
        self._ops.lora_add_(y, x, a, b, columns, order, segments, ranks)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of fp32 logits [B, V] (columns contiguous): int64 [B], the first of equal
        maxima and the first NaN where a row has one, as torch.argmax picks."""
        return self._ops.argmax_rows(logits)

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """Store fp32 k, v [B, num_kv_heads, head_dim] at `slot_mapping` [B] int64 in the dense fp32
        or bf16 pages (rounded to nearest-even in bf16), then attend fp32 q [B, num_heads, head_dim]
        (one token per sequence) over each sequence's `seq_lens` [B] int32 tokens through
        `block_tables` [B, max_blocks] int32: fp32 [B, num_heads, head_dim]."""
        return self._ops.decode_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale)

    @property
    def prefill_attention(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
        """Causal attention of a prompt chunk, `op(q, k, v, scale)`: bf16 q [T, H, D] (the last T of S
        positions, each row's heads contiguous) over bf16 k, v [S, KVH, D], D a multiple of 64: bf16
        [T, H, D] (prefill_attention.cpp). None where this build has no such op (only the avx512bf16
        build has) or the CPU has AMX, on whose tiles torch's own flash kernel runs."""
        if "amx_bf16" in cpu_flags() or not hasattr(self._ops, "prefill_attention"):
            return None
        return self._ops.prefill_attention

    @property
    def bf16_gemm(self) -> Bf16GemmOp | None:
        """The bf16 product, `op(x, packed, n, bias, fp32_out)`: bf16 x [M, K] (K even, contiguous) times
        a weight packed by `pack_bf16_pairs`, plus fp32 bias [n] or None: [M, n] in fp32 if fp32_out,
        else bf16 (bf16_gemm.cpp). None where this build has no such op (only the avx512bf16 build
        has) or the CPU has AMX, on whose tiles oneDNN's bf16 GEMM runs."""
        if "amx_bf16" in cpu_flags() or not hasattr(self._ops, "bf16_gemm"):
            return None
        return self._ops.bf16_gemm

    @property
    def bf16_gemm_fma(self) -> Bf16GemmOp | None:
        """The same product as `bf16_gemm`, over the same packed weight, through fp32 FMAs (bf16_gemm.cpp);
        None where `bf16_gemm` is None."""
        return None if self.bf16_gemm is None else self._ops.bf16_gemm_fma

    @property
    def int8_gemm(self) -> Callable[..., torch.Tensor] | None:
        """The product with activations quantized to int8 blocks of 32, `op(x, parts, u, d, m, zero, n, bias,
        fp32_out)` over a weight packed as `packing.Int8Blocks` (int8_gemm.cpp). None where this
        build has no such op (only the avx512bf16 build, which needs VNNI, has) or the CPU has AMX, whose
        bf16 tiles outrun it."""
        if "amx_bf16" in cpu_flags() or not hasattr(self._ops, "int8_gemm"):
            return None
        return self._ops.int8_gemm

    @functools.cached_property
    def bf16_products(self) -> Bf16Gemm | None:
        """The faster of the two bf16 GEMMs on this CPU, timed on first use (engine.model.kernels.bf16_choice);
        None where this build has neither."""
        fma = self.bf16_gemm_fma  # None exactly where bf16_gemm is
        return None if fma is None else choose_bf16_gemm(self.bf16_gemm, fma, pack_bf16_pairs)

    def decode_stack(self, heads: int, kv_heads: int, head_dim: int, eps: float, scale: float) -> torch.ScriptObject:
        """An empty DecodeStack (decode_stack.cpp) for layers of these shapes, to fill layer by layer:
        `add_layer(input_norm, post_norm)`, then `add_product(packed, scale, offset, bias, bits,
        group_size, rows)` for its qkv, o, gate_up and down in turn."""
        return getattr(torch.classes, self.variant.namespace).DecodeStack(heads, kv_heads, head_dim, eps, scale)

    def run_decode_stack(
        self, stack: torch.ScriptObject, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """hidden fp32 [B, hidden] (one token per sequence) through every layer of `stack`, each
        layer's K/V stored in its pages as decode_attention stores them: the last layer's output."""
        return self._ops.decode_stack(stack, hidden, cos, sin, k_caches, v_caches, slot_mapping, block_tables,
                                      seq_lens)

    def describe(self) -> str:
        """For the start-up log: the variant and the CPU flags that chose it."""
        needs = f" (CPU flags {' '.join(self.variant.cpu_flags)})" if self.variant.cpu_flags else ""
        return f"{self.variant.name}{needs}"


@functools.cache
def kernels(name: str | None = None) -> Kernels:
    """The loaded build called `name`, or with None the best one this CPU runs. RuntimeError if it
    cannot run here or cannot be built."""
    return Kernels(runnable(cpu_flags())[0] if name is None else variant_named(name))


@functools.cache
def cpu_kernels(device: str | torch.device) -> Kernels | None:
    """The best build for a CPU `device`; None for another device, or (with a warning: the engine
    then runs torch's own ops) where no build can be made here."""
    if torch.device(device).type != "cpu":
        return None
    try:
        return kernels()
    except RuntimeError as error:
        log.warning("the CPU kernels could not be built, so RMSNorm and decode attention run as torch ops: %s", error)
        return None
