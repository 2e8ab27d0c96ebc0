"""Products of integer-group weights with activations quantized to int8 (`--activation-quantization`).

On a CPU whose kernels build has AVX512-VNNI (engine.model.kernels.int8_gemm), a product of several
rows is bound by arithmetic, and VNNI's byte dot product does four times the multiply-adds of an fp32
FMA per instruction. So the activations are quantized as they enter the product, each row's blocks
of 32 symmetrically to int8 (scale = the block's largest |x| / 127), as llama.cpp's CPU products and
vLLM's GGUF kernels quantize them, and multiplied by the weight's own integers exactly; scales and
offsets are applied per block in fp32 (int8_gemm.cpp's header has the formula). "int8" is one part
(7 bits a block), "int16" two (15 bits, the second quantizing the first's rounding error) for twice
the byte products. The weight is kept once more, one byte per value, or two a byte for values of 4
bits, since a product of a few rows (a small decode batch, a speculative step's verification rows)
waits on the weight's bytes: `engine.model.kernels.packing.Int8Blocks`.

Against bf16 with dense weights the shipped model's perplexity moves by a fraction of a percent with
int8 parts and less with int16 (`python -m bench fidelity`); their speed against the bf16 GEMMs is
in docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from engine.model.kernels import Kernels
from engine.model.kernels.packing import pack_int8_blocks
from engine.model.quantized import QuantizedWeight

PARTS = {"int8": 1, "int16": 2}  # --activation-quantization -> int8 parts per activation


class Int8Product:
    """y = x·Wᵀ (+ bias) with x quantized to int8 blocks, through the kernels' int8 GEMM."""

    def __init__(self, weight: QuantizedWeight, bias32: torch.Tensor | None, ops: Kernels, parts: int = 1) -> None:
        """`parts`: int8 parts per activation (1, or 2 for 15 bits a block); ValueError where `ops` has no
        int8 GEMM or the weight's groups do not fit it."""
        op = ops.int8_gemm
        if op is None:
            raise ValueError(f"int8 activations: the {ops.describe()} kernels have no int8 GEMM (it needs "
                             "avx512_vnni, and is not used where amx_bf16 is)")
        self._op = op
        self.blocks = pack_int8_blocks(weight)
        self._bias32 = bias32
        self.parts = parts

    def __call__(self, x: torch.Tensor, fp32_out: bool) -> torch.Tensor:
        """[M, N] in fp32 if `fp32_out`, else bf16; x fp32 or bf16 [M, K] (other dtypes are widened)."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        b = self.blocks
        return self._op(x.contiguous(), self.parts, b.u, b.d, b.m, b.zero, b.rows, self._bias32, fp32_out)
