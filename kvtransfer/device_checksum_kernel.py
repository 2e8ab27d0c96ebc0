"""kvtransfer.device_checksum's sums as two Triton kernels, for pages on a GPU.

The torch form there takes about a dozen kernel launches a message, and at a layer's message size a
launch costs more than the reduction (measured on an H200: docs/benchmarks.md). Here one kernel
reduces the joined bytes to per-program partial sums and a second one folds them, takes the moduli
and packs the result: with the join, three launches a message. Each program walks `BLOCK` bytes at a
time, weighting byte i by i mod 65521 + 1 in 32-bit integers (a message is under 2 GiB: checked),
and keeps its sums in int64 lanes (255 * 65521 * 2**31 < 2**63: no overflow).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # bytes a program reduces per step
_MAX_PROGRAMS = 512  # partial sums the second kernel folds in one block
_MAX_BYTES = 1 << 31  # the byte index is an int32


@triton.jit(do_not_specialize=["n", "steps"])
def _partial_sums_kernel(data_ptr, partials_ptr, n, steps, MODULUS: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    s1 = tl.zeros([BLOCK], dtype=tl.int64)
    s2 = tl.zeros([BLOCK], dtype=tl.int64)
    for step in range(steps):
        index = (program * steps + step) * BLOCK + lanes
        inside = index < n
        value = tl.load(data_ptr + index, mask=inside, other=0).to(tl.int64) + 1
        value = tl.where(inside, value, 0)
        s1 += value
        s2 += value * (index % MODULUS + 1).to(tl.int64)
    tl.store(partials_ptr + 2 * program, tl.sum(s1, axis=0))
    tl.store(partials_ptr + 2 * program + 1, tl.sum(s2, axis=0))


@triton.jit(do_not_specialize=["count"])
def _fold_kernel(partials_ptr, out_ptr, count, PROGRAMS: tl.constexpr):
    index = tl.arange(0, PROGRAMS)
    inside = index < count
    s1 = tl.sum(tl.load(partials_ptr + 2 * index, mask=inside, other=0), axis=0) % 4294967296
    s2 = tl.sum(tl.load(partials_ptr + 2 * index + 1, mask=inside, other=0), axis=0) % 2147483648
    tl.store(out_ptr, s2 * 4294967296 + s1)


def triton_device_checksum(tensors: list[torch.Tensor], modulus: int) -> torch.Tensor:
    """The device sums of flat uint8 tensors on one device (already checked by the caller), as a
    0-dim int64 tensor there; `modulus` is the weights' (kvtransfer.device_checksum)."""
    data = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    n = data.numel()
    if n >= _MAX_BYTES:
        raise ValueError(f"a checksummed message must be under {_MAX_BYTES} bytes, got {n}")
    blocks = triton.cdiv(n, _BLOCK)
    programs = min(blocks, _MAX_PROGRAMS)
    steps = triton.cdiv(blocks, programs)
    programs = triton.cdiv(blocks, steps)
    partials = torch.empty(2 * programs, dtype=torch.int64, device=data.device)
    out = torch.empty((), dtype=torch.int64, device=data.device)
    _partial_sums_kernel[(programs,)](data, partials, n, steps, MODULUS=modulus, BLOCK=_BLOCK)
    _fold_kernel[(1,)](partials, out, programs, PROGRAMS=_MAX_PROGRAMS)
    return out
