"""A weight stored as groups of small integers, whatever format it came from.

Every quantized format the loaders read (the GGUF file's Q4_1 and Q8_0 blocks, round-to-nearest
int8, GPTQ and AWQ checkpoints) becomes this one representation, so the matrix-product kernels see
one thing and the loaders know nothing of kernels:

    w[n, k] = scale[n, g] * q[n, k] + offset[n, g],   g = k // group_size

with q one small integer per element (unpacked: the kernels pack it their own way). GPTQ's
act-order checkpoints order a row's groups by a permutation of the input features: column k of q
is input feature perm[k].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import ModelConfig


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight as integer groups (see the module docstring)."""

    q: torch.Tensor  # [N, K] int8 (signed formats) or uint8 (unsigned ones, with an offset)
    scale: torch.Tensor  # [N, K // group_size] float32
    offset: torch.Tensor | None  # [N, K // group_size] float32; None for symmetric formats
    bits: int  # 4 or 8: the range of q
    group_size: int
    perm: torch.Tensor | None = None  # [K] int64: the input feature of each column of q (GPTQ act-order)

    def __post_init__(self) -> None:
        rows, cols = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits: must be 4 or 8, got {self.bits}")
        if self.group_size <= 0 or cols % self.group_size:
            raise ValueError(f"group_size: {self.group_size} does not divide the {cols} input features")
        groups = (rows, cols // self.group_size)
        for name, groupwise in (("scale", self.scale), ("offset", self.offset)):
            if groupwise is not None and tuple(groupwise.shape) != groups:
                raise ValueError(f"{name}: expected {list(groups)}, got {list(groupwise.shape)}")
        signed = self.q.dtype == torch.int8
        if not signed and self.q.dtype != torch.uint8:
            raise ValueError(f"q: must be int8 or uint8, got {self.q.dtype}")
        if self.perm is not None and tuple(self.perm.shape) != (cols,):
            raise ValueError(f"perm: expected [{cols}], got {list(self.perm.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K]: output and input features."""
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K], columns in input-feature order."""
        rows, cols = self.shape
        groups = self.q.view(rows, cols // self.group_size, self.group_size).float()
        weight = groups * self.scale.unsqueeze(-1)
        if self.offset is not None:
            weight = weight + self.offset.unsqueeze(-1)
        weight = weight.view(rows, cols)
        if self.perm is None:
            return weight
        ordered = torch.empty_like(weight)
        ordered[:, self.perm] = weight
        return ordered


Weight = torch.Tensor | QuantizedWeight
# (the model's config, a tensor's HF name, the tensor as read) -> the part of it to hold (a
# tensor-parallel rank's shard: engine.parallel.shard.shard_tensor), None for none of it (an expert
# another rank holds)
KeepWeight = Callable[["ModelConfig", str, Weight], Weight | None]
