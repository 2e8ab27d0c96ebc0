"""Triton product y = x·Wᵀ over a QuantizedWeight, dequantized tile by tile as it is read.

For GPUs, where a decode step streams the weights once per step: 4-bit weights are packed two to a
byte (column 2j in the low nibble, 2j+1 in the high), 8-bit ones one to a byte, so a step reads a
quarter or half of what bf16 weights cost. Each program owns a tile of rows of x and of output
features, walks the input features in tiles, turns each weight tile into scale·q + offset (per
group) in fp32 and accumulates with `tl.dot`. Without a GPU it runs in Triton's interpreter (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.model.quantized import QuantizedWeight

_BLOCK_M = 16  # tl.dot needs at least 16 rows on a GPU
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0).to(tl.float32)
        valid = (ks[:, None] < K) & (cols[None, :] < N)
        if BITS == 4:
            packed = tl.load(q_ptr + cols[None, :] * stride_qn + ks[:, None] // 2, mask=valid, other=0)
            q = ((packed.to(tl.int32) >> ((ks[:, None] % 2) * 4)) & 0xF).to(tl.float32)
        else:
            q = tl.load(q_ptr + cols[None, :] * stride_qn + ks[:, None], mask=valid, other=0).to(tl.float32)
        groups = cols[None, :] * stride_sn + ks[:, None] // GROUP_SIZE
        w = q * tl.load(scale_ptr + groups, mask=valid, other=0.0)
        if HAS_OFFSET:
            w += tl.load(offset_ptr + groups, mask=valid, other=0.0)
        acc += tl.dot(x, w)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@dataclass(frozen=True)
class TritonQuantizedWeight:
    """A QuantizedWeight laid out for the kernel, on the weight's device."""

    q: torch.Tensor  # [N, K // 2] uint8 for 4 bits (two per byte), [N, K] int8/uint8 for 8
    scale: torch.Tensor  # [N, K // group_size] float32
    offset: torch.Tensor | None
    perm: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> TritonQuantizedWeight:
        """Pack `weight` (4-bit values two to a byte; an odd K cannot be packed so is refused)."""
        q = weight.q
        if weight.bits == 4:
            if q.shape[1] % 2:
                raise ValueError(f"q: 4-bit weights need an even number of input features, got {q.shape[1]}")
            q = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        return cls(q, weight.scale.float().contiguous(),
                   None if weight.offset is None else weight.offset.float().contiguous(),
                   weight.perm, weight.bits, weight.group_size, weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> x·Wᵀ [M, N] in x's dtype, accumulated in fp32."""
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.contiguous()
        rows, cols = x.shape[0], self.q.shape[0]
        out = torch.empty(rows, cols, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(cols, _BLOCK_N))
        _quantized_matmul_kernel[grid](
            x, self.q, self.scale, self.scale if self.offset is None else self.offset, out,
            rows, cols, self.in_features,
            x.stride(0), self.q.stride(0), self.scale.stride(0), out.stride(0),
            GROUP_SIZE=self.group_size, BITS=self.bits, HAS_OFFSET=self.offset is not None,
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        )
        return out.to(x.dtype)
