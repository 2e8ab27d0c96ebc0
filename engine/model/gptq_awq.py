"""Unpack GPTQ and AWQ checkpoint tensors into QuantizedWeights, under the HF weight names.

Both formats store, per linear layer `P` (e.g. `model.layers.0.self_attn.q_proj`), a weight of
N output and K input features as 32-bit words of `bits`-bit unsigned integers, and per group g of
input features a zero point z and a scale s: w[n, k] = s[g, n] * (q[k, n] - z[g, n]).

- GPTQ (AutoGPTQ, GPTQModel): `P.qweight` [K * bits / 32, N] packs q along the input features,
  lowest bits first (value i of a word at bits [i * bits, (i + 1) * bits)); `P.qzeros`
  [K / group, N * bits / 32] packs z along the output features the same way; `P.scales` [K / group, N];
  `P.g_idx` [K] the group of each input feature (act-order checkpoints put them in any group).
  The stored zero is z - 1 in the first checkpoint format ("gptq"), z itself in "gptq_v2".
- AWQ (AutoAWQ's GEMM packing, 4-bit): `P.qweight` [K, N / 8] packs q along the output features;
  word j of a row holds features 8j..8j+7 with feature 8j + ORDER[i] at bits [4i, 4i + 4), ORDER =
  (0, 2, 4, 6, 1, 3, 5, 7); `P.qzeros` [K / group, N / 8] packs z the same way; `P.scales`
  [K / group, N]. The zero is stored as is.

The result is engine.model.quantized's w[n, k] = scale[n, g] * q[n, k] + offset[n, g] with
offset = -scale * zero (exact: a fp16 scale times an integer of at most 16 fits a float32). An
act-order weight's columns are sorted by group, and within a group by input feature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.model.quant_config import CheckpointQuantization
from engine.model.quantized import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def take_quantized(tensors: dict[str, torch.Tensor], spec: CheckpointQuantization) -> dict[str, QuantizedWeight]:
    """Remove every packed layer's tensors from `tensors` and return its QuantizedWeight under the
    HF name `P.weight`. ValueError naming the tensor for a missing, mis-shaped or inconsistent one."""
    prefixes = sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight"))
    if not prefixes:
        raise ValueError(f"quantization_config says {spec.method}, but the checkpoint has no *.qweight tensors")
    quantized = {}
    for prefix in prefixes:
        if f"{prefix}.weight" in tensors:
            raise ValueError(f"{prefix}.weight: stored beside {prefix}.qweight; a layer is either packed or float")
        packed = {suffix: tensors.pop(f"{prefix}.{suffix}") for suffix in _PACKED_SUFFIXES
                  if f"{prefix}.{suffix}" in tensors}
        unpack = unpack_gptq if spec.method == "gptq" else unpack_awq
        quantized[f"{prefix}.weight"] = unpack(prefix, packed, spec)
    return quantized


def unpack_gptq(prefix: str, packed: Mapping[str, torch.Tensor], spec: CheckpointQuantization) -> QuantizedWeight:
    """One GPTQ layer's QuantizedWeight from its `qweight`, `qzeros`, `scales` and optional `g_idx`."""
    qweight, qzeros, scales = (_required(prefix, packed, suffix) for suffix in ("qweight", "qzeros", "scales"))
    per_word = 32 // spec.bits
    in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
    if out_features % per_word:
        raise ValueError(f"{prefix}.qweight: {out_features} output features do not fill whole qzeros words")
    group_size, groups = _groups(prefix, in_features, spec.group_size)
    _expect_shape(prefix, "qzeros", qzeros, (groups, out_features // per_word))
    _expect_shape(prefix, "scales", scales, (groups, out_features))
    q = unpack_words(qweight, spec.bits, along_rows=True)  # [K, N]
    zeros = unpack_words(qzeros, spec.bits, along_rows=False) + spec.zero_offset  # [G, N]
    if spec.sym and not bool((zeros == 1 << (spec.bits - 1)).all()):
        raise ValueError(
            f"{prefix}.qzeros: quantization_config.sym is true, so every zero point is {1 << (spec.bits - 1)}, but "
            f"this checkpoint's stored zeros plus {spec.zero_offset} (its checkpoint_format) are not: the "
            "checkpoint_format does not match how its zero points were stored")
    perm = _act_order(prefix, packed.get("g_idx"), in_features, group_size, spec.desc_act)
    if perm is not None:
        q = q[perm]
    return _quantized_weight(q, zeros, scales, spec.bits, group_size, perm)


def unpack_awq(prefix: str, packed: Mapping[str, torch.Tensor], spec: CheckpointQuantization) -> QuantizedWeight:
    """One AWQ (GEMM) layer's QuantizedWeight from its `qweight`, `qzeros` and `scales`."""
    if "g_idx" in packed:
        raise ValueError(f"{prefix}.g_idx: AWQ checkpoints have no act-order indices")
    qweight, qzeros, scales = (_required(prefix, packed, suffix) for suffix in ("qweight", "qzeros", "scales"))
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    group_size, groups = _groups(prefix, in_features, spec.group_size)
    _expect_shape(prefix, "qzeros", qzeros, (groups, out_features // 8))
    _expect_shape(prefix, "scales", scales, (groups, out_features))
    q = unpack_words(qweight, 4, along_rows=False, order=AWQ_ORDER)  # [K, N]
    zeros = unpack_words(qzeros, 4, along_rows=False, order=AWQ_ORDER)  # [G, N]
    return _quantized_weight(q, zeros, scales, 4, group_size, None)


def unpack_words(words: torch.Tensor, bits: int, along_rows: bool, order: Sequence[int] | None = None) -> torch.Tensor:
    """The int32 [R, C] `words` spread into 32 // bits values each, lowest bits first: [R * 32 // bits, C]
    along the rows, [R, C * 32 // bits] along the columns. With `order`, the value at position i of a
    word belongs to element order[i] of the word's run."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per_word]: the sign bits masked off
    if order is not None:
        values = values[..., _inverse(order)]
    rows, cols = words.shape
    if along_rows:
        return values.permute(0, 2, 1).reshape(rows * per_word, cols)
    return values.reshape(rows, cols * per_word)


def _quantized_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                      perm: torch.Tensor | None) -> QuantizedWeight:
    scale = scales.float().t().contiguous()  # [N, G]
    return QuantizedWeight(
        q=q.t().to(torch.uint8).contiguous(),
        scale=scale,
        offset=-scale * zeros.t().float(),
        bits=bits,
        group_size=group_size,
        perm=perm,
    )


def _act_order(prefix: str, g_idx: torch.Tensor | None, in_features: int, group_size: int,
               desc_act: bool) -> torch.Tensor | None:
    """The permutation that sorts the input features by group (None when they already are)."""
    if g_idx is None:
        if desc_act:
            raise ValueError(f"{prefix}.g_idx: missing (quantization_config.desc_act is true)")
        return None
    _expect_shape(prefix, "g_idx", g_idx, (in_features,))
    if g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{prefix}.g_idx: expected integer group indices, got {g_idx.dtype}")
    g_idx = g_idx.long()
    groups = in_features // group_size
    if bool(((g_idx < 0) | (g_idx >= groups)).any()):
        raise ValueError(f"{prefix}.g_idx: group indices outside [0, {groups})")
    sizes = torch.bincount(g_idx, minlength=groups)
    if bool((sizes != group_size).any()):
        bad = int((sizes != group_size).nonzero()[0])
        raise ValueError(f"{prefix}.g_idx: group {bad} has {int(sizes[bad])} input features, not group_size "
                         f"{group_size}; such a grouping is not a permutation of whole groups")
    if bool((g_idx == torch.arange(in_features) // group_size).all()):
        return None
    if not desc_act:
        raise ValueError(f"{prefix}.g_idx: reorders the input features, but quantization_config.desc_act is false")
    return torch.argsort(g_idx, stable=True)


def _groups(prefix: str, in_features: int, group_size: int) -> tuple[int, int]:
    size = in_features if group_size == -1 else group_size
    if in_features % size:
        raise ValueError(f"{prefix}.qweight: {in_features} input features are not whole groups of {size}")
    return size, in_features // size


def _required(prefix: str, packed: Mapping[str, torch.Tensor], suffix: str) -> torch.Tensor:
    tensor = packed.get(suffix)
    if tensor is None:
        raise ValueError(f"{prefix}.{suffix}: missing (a packed layer needs qweight, qzeros and scales)")
    if suffix == "scales" and not tensor.is_floating_point():
        raise ValueError(f"{prefix}.scales: expected floating-point scales, got {tensor.dtype}")
    if suffix != "scales" and tensor.dtype != torch.int32:
        raise ValueError(f"{prefix}.{suffix}: expected int32 words, got {tensor.dtype}")
    if tensor.dim() != 2:
        raise ValueError(f"{prefix}.{suffix}: expected 2 dimensions, got {list(tensor.shape)}")
    return tensor


def _expect_shape(prefix: str, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{prefix}.{suffix}: expected {list(shape)}, got {list(tensor.shape)}")


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, element in enumerate(order):
        inverse[element] = position
    return inverse
