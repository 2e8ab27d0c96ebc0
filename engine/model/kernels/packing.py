"""The byte layouts the C++ kernels read their weights in: each is packed once at load, here beside the
kernels whose headers define it, so the products (engine.model.quantized_linear, int8_activations) and
the kernels' wrappers (engine.model.kernels) share one contract and none of them imports another.

- `PackedWeight` (qmatmul_core.h, decode_stack.cpp): integer groups in blocks of 8 rows, 4-bit values
  two to a byte in spans of 64 that unpack without byte shuffles, 8-bit values as int8, fp32 scales
  and offsets per group. Each weight the kernel multiplies is fl(scale·q), the first rounding of
  QuantizedWeight.dequantize(); the offset enters as offset·Σx over the group. Signed 4-bit and
  unsigned 8-bit values are shifted into the stored range and the shift folded into the offset (one
  more rounding of the offset there).
- `pack_bf16_pairs` (bf16_gemm.cpp): a bf16 weight in panels of 16 rows holding K as pairs.
- `Int8Blocks` (int8_gemm.cpp): integer groups as unsigned bytes (nibbles for values of 4 bits) in
  panels of 16 outputs, scales and offsets per block of 32 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.quantized import QuantizedWeight

KERNEL_CHUNK = 32  # the kernels unpack 32 weights at a time: group sizes must be multiples of it
BLOCK_ROWS = 8  # rows interleaved in the kernels' layout
SPAN = 64  # 4-bit weights per span: 8 words of 8 nibbles
INT8_BLOCK = 32  # int8_gemm: activations per quantization block
INT8_PANEL = 16  # int8_gemm: outputs per packed panel
BF16_PANEL = 16  # bf16_gemm: rows per packed panel


def has_kernel(weight: QuantizedWeight) -> bool:
    """Whether the CPU kernels take this weight's layout (groups of a multiple of 32 weights)."""
    return weight.group_size % KERNEL_CHUNK == 0


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in the kernels' layout (qmatmul_core.h): rows in blocks of 8, the last padded;
    within a block, 8-bit values chunk by chunk of 32 weights, 4-bit ones span by span of 64 (`_spans`)."""

    packed: torch.Tensor  # uint8 [blocks, K*4] (4-bit: two to a byte) or int8 [blocks, K*8] (8-bit)
    scale: torch.Tensor  # float32 [blocks, groups, 8]
    offset: torch.Tensor | None  # float32 [blocks, groups, 8]
    bits: int
    group_size: int
    rows: int
    perm: torch.Tensor | None  # [K]: x's columns in q's order, for act-order weights

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> PackedWeight:
        """Pack once at load; ValueError for a layout the kernels do not take."""
        if not has_kernel(weight):
            raise ValueError(f"group_size: the CPU kernels need a multiple of {KERNEL_CHUNK}, got {weight.group_size}")
        rows, cols = weight.shape
        scale = weight.scale.float()
        offset = None if weight.offset is None else weight.offset.float()
        q = weight.q
        if weight.bits == 4:
            if q.dtype == torch.int8:  # -8..7 stored as 0..15: w = scale·(q' - 8)
                q, offset = (q + 8).to(torch.uint8), _shifted(offset, scale, -8.0)
            packed = _spans(q)
        else:
            if q.dtype == torch.uint8:  # 0..255 stored as -128..127: w = scale·(q' + 128)
                q, offset = (q.to(torch.int16) - 128).to(torch.int8), _shifted(offset, scale, 128.0)
            packed = _blocked(q.view(rows, -1, KERNEL_CHUNK)).reshape(-1, cols * 8)
        return cls(packed, _blocked(scale),
                   None if offset is None else _blocked(offset), weight.bits, weight.group_size, rows,
                   None if weight.perm is None else weight.perm.long())

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K]."""
        return (self.rows, self.packed.shape[1] // self.bits)


def _spans(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [rows, K] (0..15) in the kernels' layout (qmatmul_core.h): per block of 8 rows,
    span by span of 64 weights (a last one of 32 where K is an odd number of chunks), each row's
    span as little-endian words whose nibble s of word l is weight 8s + l; [blocks, K * 4] bytes."""
    rows, cols = q.shape
    full = cols // SPAN * SPAN

    def words(part: torch.Tensor, nibbles: int) -> torch.Tensor:
        # byte b of word l holds nibbles 2b (low) and 2b + 1 (high): weights 16b + l and 16b + 8 + l.
        pairs = part.reshape(rows, -1, nibbles // 2, 2, 8)
        data = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)  # [rows, spans, byte b, word l]
        return _blocked(data.transpose(2, 3).reshape(rows, -1, 8 * nibbles // 2))

    parts = [words(q[:, :full], 8)]
    if full < cols:
        parts.append(words(q[:, full:], 4))
    blocks = parts[0].shape[0]
    return torch.cat([part.reshape(blocks, -1) for part in parts], dim=1).contiguous()


def _blocked(per_row: torch.Tensor) -> torch.Tensor:
    """[rows, a, (b)] -> [blocks, a, 8, (b)]: rows padded to a multiple of 8, each block's rows
    interleaved along the second dimension."""
    rows = per_row.shape[0]
    padded = -rows % BLOCK_ROWS
    if padded:
        per_row = torch.cat([per_row, per_row.new_zeros(padded, *per_row.shape[1:])])
    blocks = per_row.view(-1, BLOCK_ROWS, *per_row.shape[1:])
    return blocks.transpose(1, 2).contiguous()


def _shifted(offset: torch.Tensor | None, scale: torch.Tensor, shift: float) -> torch.Tensor:
    return scale * shift if offset is None else offset + scale * shift


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (K even) in bf16_gemm's layout: [ceil(N/16), K/2, 16, 2], panels of 16
    rows (the last padded with zeros) holding each row's K dimension as pairs."""
    rows, cols = weight.shape
    if cols % 2:
        raise ValueError(f"pack_bf16_pairs: K must be even, got {cols}")
    panels = -(-rows // BF16_PANEL)
    padded = torch.zeros(panels * BF16_PANEL, cols, dtype=torch.bfloat16)
    padded[:rows] = weight
    return padded.view(panels, BF16_PANEL, cols // 2, 2).permute(0, 2, 1, 3).contiguous()


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
        return self.u.shape[1] * 8 == self.d.shape[1] * INT8_BLOCK


def packable_int8(weight: QuantizedWeight) -> bool:
    """Whether int8_gemm takes this weight: groups of whole blocks of 32."""
    return weight.group_size % INT8_BLOCK == 0 and weight.shape[1] % INT8_BLOCK == 0


def pack_int8_blocks(weight: QuantizedWeight) -> Int8Blocks:
    """The weight's values as bytes in panels (as nibbles where they have 4 bits or fewer), its scales
    and offsets repeated per block of 32."""
    if not packable_int8(weight):
        raise ValueError(f"int8 activations: group size {weight.group_size} is not a multiple of {INT8_BLOCK}")
    rows, cols = weight.shape
    signed = weight.q.dtype == torch.int8
    nibbles = weight.bits <= 4
    shift = (8 if nibbles else 128) if signed else 0
    u = (weight.q.to(torch.int16) + shift).to(torch.uint8)
    panels = -(-rows // INT8_PANEL)
    padded = torch.zeros(panels * INT8_PANEL, cols, dtype=torch.uint8)
    padded[:rows] = u
    packed = padded.view(panels, INT8_PANEL, cols // 4, 4).permute(0, 2, 1, 3).contiguous()
    if nibbles:
        quads = packed.view(panels, cols // INT8_BLOCK, 2, INT8_BLOCK // 8, INT8_PANEL, 4)
        packed = (quads[:, :, 0] | (quads[:, :, 1] << 4)).reshape(panels, cols // 8, INT8_PANEL, 4).contiguous()

    def per_block(groupwise: torch.Tensor) -> torch.Tensor:
        blocks = groupwise.float().repeat_interleave(weight.group_size // INT8_BLOCK, dim=1)
        out = torch.zeros(panels * INT8_PANEL, cols // INT8_BLOCK)
        out[:rows] = blocks
        return out.view(panels, INT8_PANEL, cols // INT8_BLOCK).permute(0, 2, 1).contiguous()

    offset = None if weight.offset is None else per_block(weight.offset)
    return Int8Blocks(packed, per_block(weight.scale), offset, shift, rows)
