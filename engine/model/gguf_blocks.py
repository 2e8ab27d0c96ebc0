"""GGUF's integer block types as QuantizedWeights: the file's own values, without a float round trip.

Each mapping reproduces gguf-py's dequantization (gguf.quants) bit for bit through
QuantizedWeight.dequantize(), since every d (and m) is an fp16 value and d·q is exact in fp32:

- Q8_0 (32 int8 and an fp16 d per block): w = d·q; q int8, scale d, no offset.
- Q4_0 (32 nibbles, fp16 d): w = d·(nibble - 8); q int8 in -8..7, scale d, no offset.
- Q4_1 (32 nibbles, fp16 d and m): w = d·q + m; q uint8 in 0..15, scale d, offset m.
- Q4_K (256 weights in 8 groups of 32; fp16 d and dmin, 6-bit sc and mn per group):
  w = (d·sc)·q - dmin·mn; q uint8 in 0..15, scale d·sc, offset -dmin·mn (both exact in fp32).

Every other block type (Q5_*, Q6_K, Q2_K, Q3_K, Q5_K, the IQ types, ...) returns None here: the
loader dequantizes it and the engine names it in a start-up warning when serving "gguf".
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

from engine.model.quantized import QuantizedWeight

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def as_quantized(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight | None:
    """The [rows, cols] tensor stored as `data` (the file's block bytes) in integer groups, or None
    for a block type not mapped here."""
    mapping = _MAPPINGS.get(qtype)
    if mapping is None:
        return None
    block_bytes, split = mapping
    q, scale, offset, bits = split(np.ascontiguousarray(data).view(np.uint8).reshape(-1, block_bytes))
    rows, cols = shape
    groups = cols // 32
    return QuantizedWeight(
        q=torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
        scale=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, groups)),
        offset=None if offset is None else torch.from_numpy(
            np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, groups)),
        bits=bits,
        group_size=32,
    )


_Split = tuple[np.ndarray, np.ndarray, np.ndarray | None, int]  # q, scale and offset per group of 32, bits


def _q8_0(blocks: np.ndarray) -> _Split:
    return blocks[:, 2:].view(np.int8), _fp16(blocks[:, :2]), None, 8


def _q4_0(blocks: np.ndarray) -> _Split:
    return _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8), _fp16(blocks[:, :2]), None, 4


def _q4_1(blocks: np.ndarray) -> _Split:
    return _nibbles(blocks[:, 4:]), _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4]), 4


def _q4_k(blocks: np.ndarray) -> _Split:
    d, dmin = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    # 128 bytes: four runs of 32, whose low nibbles are one group of 32 and high nibbles the next.
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(-1, 256)
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 4


_MAPPINGS = {
    GGMLQuantizationType.Q8_0: (34, _q8_0),
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_1: (20, _q4_1),
    GGMLQuantizationType.Q4_K: (144, _q4_k),
}
SERVED_TYPES = tuple(_MAPPINGS)


def _fp16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # Weights 0..15 of a block are the low nibbles of its 16 bytes, weights 16..31 the high ones.
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def permute_rows(weight: QuantizedWeight, order: np.ndarray) -> QuantizedWeight:
    """The weight with its rows taken in `order` (row i of the result is row order[i])."""
    index = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
    return QuantizedWeight(
        q=weight.q[index], scale=weight.scale[index],
        offset=None if weight.offset is None else weight.offset[index],
        bits=weight.bits, group_size=weight.group_size, perm=weight.perm,
    )
