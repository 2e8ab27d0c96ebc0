"""One tensor-parallel rank's part of a LoRA adapter, cut by the rule that cuts the base projection
it adds to (engine.parallel.shard), so that each rank's LoRA term is the part of the whole term its
part of the product computes.

LoRA adds (x·Aᵀ)·Bᵀ to a projection, A [r, in], B [out, r]. A column-parallel product (q, k, v,
gate, up) keeps the rows of its output the rank computes: B keeps those rows and A is whole (the
rank has every input feature). A row-parallel product (o, down) keeps the columns of its input the
rank holds: A keeps those columns and B is whole, so each rank's term is a partial sum over its
input features, which joins the base's partial sum before their one all-reduce
(engine.parallel.collectives) and the ranks' terms add up to the whole term exactly once. The KV
heads' rows follow the base's, replicated ones included (engine.parallel.layout).
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.lora.adapter import MODULES, LoraWeights
from engine.lora.slots import Shard, Weights
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.shard import rows, split


def shard_adapter(layout: TensorParallelLayout, config: ModelConfig, weights: Weights) -> dict[tuple[int, str],
                                                                                                LoraWeights]:
    """Rank `layout.rank`'s part of an adapter's `weights` on the whole model `config` describes."""
    held = {}
    for (layer, module), lora in weights.items():
        block = "mlp" if MODULES[module] in ("gate_up", "down") else "self_attn"
        name = f"model.layers.{layer}.{block}.{module}.weight"
        rule = split(layout, config, name)
        assert rule is not None, name  # every projection LoRA adapts is split
        cut, keep = rule
        # A's input features are the projection's (its columns); B's output rows are the projection's.
        held[(layer, module)] = (LoraWeights(lora.a, rows(name, lora.b, keep)) if cut is rows
                                 else LoraWeights(cut(name, lora.a, keep), lora.b))
    return held


def adapter_shard(layout: TensorParallelLayout, config: ModelConfig) -> Shard | None:
    """What rank `layout.rank` keeps of each adapter on `config`'s model (None at one rank: all of it)."""
    if layout.size == 1:
        return None
    return lambda weights: shard_adapter(layout, config, weights)
