"""One rank's part of a model's HF-named weights (engine.parallel.layout says which part).

Column-parallel products (the QKV and gate/up products, the embedding and the LM head) keep the
rows of their outputs that the rank computes; row-parallel ones (the attention output and the MLP's
down projection) keep the columns of their inputs, so each rank's output is a partial sum that one
all-reduce completes. Integer-group weights (engine.model.quantized) split the same way: a row split
keeps whole groups, a column split must fall on a group boundary (refused by name otherwise), and a
GPTQ act-order weight, whose columns are a permutation of the input features, is refused under a
column split rather than regrouped. Norm weights are replicated.

A mixture of experts' tensors split as engine.parallel.layout says: each expert's (and the shared
expert's) gate/up rows and down columns by the rank's share of their intermediate features, or under
expert parallelism whole experts, the others' not held at all; the router and the shared expert's
gate are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from engine.config import ModelConfig
from engine.model.loader import ModelFiles
from engine.model.quantized import QuantizedWeight, Weight
from engine.parallel.layout import TensorParallelLayout


def _feature_range(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _own(part: torch.Tensor) -> torch.Tensor:
    """A slice in storage of its own, so the whole tensor it came from can be freed."""
    return part.clone(memory_format=torch.contiguous_format)


def rows(name: str, weight: Weight, keep: range) -> Weight:
    """The output rows `keep` of `weight` (a bias: its entries); `name` for the same signature as
    `columns`."""
    if isinstance(weight, QuantizedWeight):
        offset = None if weight.offset is None else _own(weight.offset[keep.start:keep.stop])
        return replace(weight, q=_own(weight.q[keep.start:keep.stop]), scale=_own(weight.scale[keep.start:keep.stop]),
                       offset=offset)
    return _own(weight[keep.start:keep.stop])


def columns(name: str, weight: Weight, keep: range) -> Weight:
    """The input columns `keep` of `weight`; ValueError naming the tensor when they would cut its
    integer groups or it is act-ordered."""
    if not isinstance(weight, QuantizedWeight):
        return _own(weight[:, keep.start:keep.stop])
    if weight.perm is not None:
        raise ValueError(f"{name}: a GPTQ act-order weight cannot be split by its input features "
                         "(tensor parallelism splits this product's columns); use a checkpoint without desc_act")
    group = weight.group_size
    if keep.start % group or len(keep) % group:
        raise ValueError(f"{name}: splitting its {weight.shape[1]} input features at {keep.start}..{keep.stop} "
                         f"would cut its groups of {group}")
    first, last = keep.start // group, keep.stop // group
    offset = None if weight.offset is None else _own(weight.offset[:, first:last])
    return replace(weight, q=_own(weight.q[:, keep.start:keep.stop]), scale=_own(weight.scale[:, first:last]),
                   offset=offset)


Cut = Callable[[str, Weight, range], Weight]  # `rows` or `columns`

# The product each tensor belongs to (by its last two name parts): how it splits, and by what.
_SPLITS: dict[str, tuple[Cut, str]] = {
    "q_proj.weight": (rows, "q"), "q_proj.bias": (rows, "q"),
    "k_proj.weight": (rows, "kv"), "k_proj.bias": (rows, "kv"),
    "v_proj.weight": (rows, "kv"), "v_proj.bias": (rows, "kv"),
    "o_proj.weight": (columns, "q"),
    "gate_proj.weight": (rows, "inter"), "up_proj.weight": (rows, "inter"),
    "down_proj.weight": (columns, "inter"),
    "embed_tokens.weight": (rows, "vocab"), "lm_head.weight": (rows, "vocab"),
}
_EXPERT = re.compile(r".*\.mlp\.(?:experts\.(\d+)|shared_expert)\.(gate|up|down)_proj\.weight")


def _shard_expert(layout: TensorParallelLayout, config: ModelConfig, name: str, weight: Weight,
                  match: re.Match[str]) -> Weight | None:
    expert, proj = match.groups()
    if expert is None:
        keep = layout.shared_intermediate(config)
    elif int(expert) not in layout.experts(config):
        return None
    else:
        keep = layout.expert_intermediate(config)
    if len(keep) == weight.shape[0 if proj != "down" else 1]:
        return weight
    return columns(name, weight, keep) if proj == "down" else rows(name, weight, keep)


def shard_tensor(layout: TensorParallelLayout, config: ModelConfig, name: str, weight: Weight) -> Weight | None:
    """Rank `layout.rank`'s part of one tensor of `config`'s model (norms: the whole tensor; None:
    an expert another rank holds). A loader calls it on each tensor as it reads it
    (engine.model.loader), so a rank never holds the whole model. ValueError naming the numbers for
    a size the model cannot take."""
    layout.check(config)
    expert = _EXPERT.fullmatch(name) if config.moe is not None else None
    if expert is not None:
        return _shard_expert(layout, config, name, weight, expert)
    rule = split(layout, config, name)
    if rule is None:
        return weight
    cut, keep = rule
    return cut(name, weight, keep)


def split(layout: TensorParallelLayout, config: ModelConfig, name: str) -> tuple[Cut, range] | None:
    """How rank `layout.rank` cuts a dense model's tensor `name`: `rows` or `columns`, and the range
    of them it keeps; None for a tensor every rank holds whole (a LoRA adapter's A and B split by
    the same rule as the projection they add to: engine.parallel.adapter_shard)."""
    rule = _SPLITS.get(".".join(name.split(".")[-2:]))
    if rule is None:
        return None
    cut, part = rule
    head_dim = config.head_dim
    keep = {"q": _feature_range(layout.query_heads(config), head_dim),
            "kv": _feature_range(layout.kv_heads(config), head_dim),
            "inter": layout.intermediate(config), "vocab": layout.vocabulary(config)}[part]
    return cut, keep


def shard_weights(weights: Mapping[str, Weight], config: ModelConfig,
                  layout: TensorParallelLayout) -> dict[str, Weight]:
    """Rank `layout.rank`'s tensors, under the same names, shaped for `layout.shard_config(config)`."""
    return {name: held for name, weight in weights.items()
            if (held := shard_tensor(layout, config, name, weight)) is not None}


def shard_files(files: ModelFiles, layout: TensorParallelLayout) -> ModelFiles:
    """`files` as rank `layout.rank` holds them: its part of the weights, the config of its shape
    (at size 1, `files` itself)."""
    if layout.size == 1:
        return files
    return replace(files, config=layout.shard_config(files.config),
                   weights=shard_weights(files.weights, files.config, layout))
