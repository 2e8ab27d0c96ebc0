"""torch's own packed CPU products over a QuantizedWeight, for the weight_formats suite to time
beside Tandem's kernels (issue 20 asks for them measured against each other).

- `_weight_int4pack_mm_for_cpu` (4-bit, a scale and a zero per group of 32): torch computes
  w = (q - 8)·scale + zero, so a Q4_1 block (w = d·q + m) maps to zero = m + 8·d; `weight_error`
  says how far that moves a weight (fp32 rounding of m + 8·d only).
- `_weight_int8pack_mm` (int8, one scale per output channel): Q8_0 has a scale per 32 weights, so
  it cannot take the file's blocks as they are; it takes a per-channel requantization (engine.model.int8).

`_dyn_quant_matmul_4bit` quantizes the activations as well (dynamic int8), which the weight-only
formats exclude, so it is not a candidate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.int8 import quantize_int8
from engine.model.quantized import QuantizedWeight

Product = Callable[[torch.Tensor], torch.Tensor]
INNER_K_TILES = 2  # the packing's tile width along K that torch's CPU kernel reads


def int4pack(weight: QuantizedWeight, dtype: torch.dtype) -> Product:
    """torch's int4 product over a 4-bit weight with offsets (Q4_1), activations in `dtype`."""
    if weight.bits != 4 or weight.offset is None or weight.perm is not None:
        raise ValueError("int4pack takes 4-bit weights with an offset per group and no act-order")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), INNER_K_TILES)
    scale = weight.scale.float()
    scales_and_zeros = torch.stack([scale.t(), (weight.offset.float() + 8 * scale).t()], dim=-1).contiguous()
    scales_and_zeros = scales_and_zeros.to(dtype)
    group = weight.group_size
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, group, scales_and_zeros)


def int8pack(weight: QuantizedWeight, dtype: torch.dtype) -> Product:
    """torch's int8 product over `weight` requantized to int8 per output channel, activations in `dtype`."""
    channels = quantize_int8(weight.dequantize())
    scales = channels.scale.reshape(-1).to(dtype)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(dtype), channels.q, scales)


def weight_error(product: Product, weight: QuantizedWeight, dtype: torch.dtype) -> float:
    """max |w' - w| over the weight a product applies (read back through the identity matrix)
    against the exact dequantized one."""
    columns = weight.shape[1]
    applied = product(torch.eye(columns, dtype=dtype)).float().t()
    return float((applied - weight.dequantize()).abs().max())
