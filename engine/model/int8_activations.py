"""Products of integer-group weights with activations quantized to int8 (`--activation-quantization`).

On a CPU whose kernels build has AVX512-VNNI (engine.model.kernels.int8_gemm), a product of several
rows is bound by arithmetic, and VNNI's byte dot product does four times the multiply-adds of an fp32
FMA per instruction. So the activations are quantized as they enter the product, each row's blocks
of 32 symmetrically to int8 (scale = the block's largest |x| / 127), as llama.cpp's CPU products and
vLLM's GGUF kernels quantize them, and multiplied by the weight's own integers exactly; scales and
offsets are applied per block in fp32 (int8_gemm.cpp's header has the formula). "int8" is one part
(7 bits a block), "int16" two (15 bits, the second quantizing the first's rounding error) for twice
the byte products. The weight is kept once more, one byte per value, or two a byte for values of 4
bits (a product of a few rows, a small decode batch or a speculative step's verification rows, waits
on the weight's bytes: one thread of the Xeon, a batch-1 step with 4 drafts, 33.3 ms with bytes
and 28.1 with nibbles): `Int8Blocks`.

The shipped model, 8 windows of 512 tokens (python -m bench fidelity), against bf16 with dense weights
(42.218): the file's blocks with int8 activations 42.340 (+0.29%), with int16 42.197; one thread of an
Intel Xeon (Emerald Rapids), the layer products at 32 rows: int8 1.08 ms, int16 1.73, bf16 through
fp32 FMAs 2.36 (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.kernels import Kernels
from engine.model.quantized import QuantizedWeight

BLOCK = 32  # activations per quantization block
PARTS = {"int8": 1, "int16": 2}  # --activation-quantization -> int8 parts per activation
# Inputs of fewer rows stay on the 4-bit kernel (engine.model.quantized_linear), which reads half the
# bytes. One thread of the Intel Xeon, the 120 layer products over 30 layers' weights: 1 row 9.8 ms
# there against 12.4 here, 2 rows 19.7 against 13.1, 3 rows 34.4 against 14.2; in the engine a
# decode step at 3 sequences took 20-25 ms against 34-35 through the 4-bit decode stack (at 2, a wash).
MIN_ROWS = 2
PANEL = 16  # outputs per packed panel


@dataclass(frozen=True)
class Int8Blocks:
    """A QuantizedWeight in int8_gemm's layout: w = d·(u − zero) + m per block of 32 inputs."""

    # [P, K/4, 16, 4] uint8: panels of 16 outputs, four consecutive inputs per 4 bytes; for values of
    # 4 bits, [P, K/8, 16, 4]: of each block's 8 such rows, rows h and h + 4 share row h's bytes as
    # low and high nibbles (half the bytes to stream)
    u: torch.Tensor
    d: torch.Tensor  # [P, K/32, 16] fp32: each block's scale
    m: torch.Tensor | None  # [P, K/32, 16] fp32: each block's offset; None without offsets
    zero: int  # 0 for unsigned values; signed ones are stored shifted by 128, or by 8 in nibbles
    rows: int  # N: the weight's outputs

    @property
    def nibbles(self) -> bool:
        """Whether u holds two values a byte."""
        return self.u.shape[1] * 8 == self.d.shape[1] * BLOCK


def packable(weight: QuantizedWeight) -> bool:
    """Whether int8_gemm takes this weight: groups of whole blocks of 32."""
    return weight.group_size % BLOCK == 0 and weight.shape[1] % BLOCK == 0


def pack_int8_blocks(weight: QuantizedWeight) -> Int8Blocks:
    """The weight's values as bytes in panels (as nibbles where they have 4 bits or fewer), its scales
    and offsets repeated per block of 32."""
    if not packable(weight):
        raise ValueError(f"int8 activations: group size {weight.group_size} is not a multiple of {BLOCK}")
    rows, cols = weight.shape
    signed = weight.q.dtype == torch.int8
    nibbles = weight.bits <= 4
    shift = (8 if nibbles else 128) if signed else 0
    u = (weight.q.to(torch.int16) + shift).to(torch.uint8)
    panels = -(-rows // PANEL)
    padded = torch.zeros(panels * PANEL, cols, dtype=torch.uint8)
    padded[:rows] = u
    packed = padded.view(panels, PANEL, cols // 4, 4).permute(0, 2, 1, 3).contiguous()
    if nibbles:
        quads = packed.view(panels, cols // BLOCK, 2, BLOCK // 8, PANEL, 4)
        packed = (quads[:, :, 0] | (quads[:, :, 1] << 4)).reshape(panels, cols // 8, PANEL, 4).contiguous()

    def per_block(groupwise: torch.Tensor) -> torch.Tensor:
        blocks = groupwise.float().repeat_interleave(weight.group_size // BLOCK, dim=1)
        out = torch.zeros(panels * PANEL, cols // BLOCK)
        out[:rows] = blocks
        return out.view(panels, PANEL, cols // BLOCK).permute(0, 2, 1).contiguous()

    offset = None if weight.offset is None else per_block(weight.offset)
    return Int8Blocks(packed, per_block(weight.scale), offset, shift, rows)


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
