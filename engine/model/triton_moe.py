"""Every expert's products of a MoE step as one Triton launch each (gate/up, then down) on CUDA.

The experts' float weights are stacked ([experts, out, in]); the step's rows, sorted by expert
(engine.model.moe.Routing), are cut into tiles of at most BLOCK_M rows that never straddle two
experts, and each program computes one tile's rows against its expert's weight tile by tile, so a
decode step of many experts is two launches instead of two products per expert hit (on a GPU a
launch costs more than a small expert's product). Without a GPU it runs in Triton's interpreter
(tests), where it is checked against the per-expert loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.moe import Gate

_BLOCK_M = 16  # tl.dot needs at least 16 rows on a GPU
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K,
    stride_xm, stride_we, stride_wn, stride_om,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < end) & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        if IEEE:  # fp32 weights: exact products, not TF32's
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < end) & (cols[None, :] < N))


def _tiles(bounds: list[int], held: range, device: torch.device) -> torch.Tensor:
    """[3, tiles] int32: each tile's expert (index among the held ones), first row and end row, the
    rows counted from the held experts' first."""
    first = bounds[held.start]
    tiles = [(index, start - first, min(start + _BLOCK_M, bounds[e + 1]) - first)
             for index, e in enumerate(held) for start in range(bounds[e], bounds[e + 1], _BLOCK_M)]
    return torch.tensor(tiles, dtype=torch.int32).T.contiguous().to(device)


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r]·weights[e]ᵀ for each tile's rows r and expert e: x [rows, K], weights [experts, N, K]."""
    x = x.contiguous()
    rows, (_, cols, features) = x.shape[0], weights.shape
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    grid = (tiles.shape[1], triton.cdiv(cols, _BLOCK_N))
    _grouped_matmul_kernel[grid](
        x, weights, out, tiles[0], tiles[1], tiles[2], cols, features,
        x.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        IEEE=x.dtype == torch.float32, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return out


class TritonExperts:
    """The held experts' SwiGLU products as two grouped launches (see the module): `gate_up`
    [experts, 2I, hidden] and `down` [experts, hidden, I], the held experts' in id order."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gate: Gate) -> None:
        self.gate_up = gate_up.contiguous()
        self.down = down.contiguous()
        self.gate = gate

    def __call__(self, gathered: torch.Tensor, bounds: list[int], held: range) -> torch.Tensor:
        tiles = _tiles(bounds, held, gathered.device)
        return grouped_matmul(self.gate(grouped_matmul(gathered, self.gate_up, tiles)), self.down, tiles)
