"""The adapters a model runner holds in memory: a fixed number of slots (`--max-loras`), each able
to hold one adapter of rank up to `--max-lora-rank`, preallocated so that loading an adapter is a
copy into a slot and never an allocation in the middle of serving.

Per layer and per engine product (the fused qkv and gate_up, o, down), each PEFT module (q, k, v,
...) has A [in, slots, width] and B [slots, width, out], `width` the max rank rounded up to 8 (the CPU
kernel reads rank values eight at a time); a slot remembers its adapter's rank so grouped products
read only A[:, slot, :rank] and B[slot, :rank]. Rank values past an adapter's rank and a module an
adapter does not target stay zero, so they add nothing. Both layouts serve every product form
(engine.lora.batch) without a copy: the masked products read a run of slots whole, as A[:, first:last]
viewed [in, slots x width] and B[first:last] viewed [slots x width, out]; the CPU kernel reads a slot's
rank values of A's row i contiguously (its shrink is vectorised over rank) and a slot's B rows
contiguously (its expand over output columns).

A rank of a tensor-parallel engine holds slots of its part of each product (its model's config is
its shard's), and keeps of each adapter the part its `shard` says (engine.parallel.adapter_shard).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.lora.adapter import MODULES, LoraWeights, projection_shape

# Each engine product's PEFT modules, in the order of the product's output columns.
PRODUCT_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                   "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
Weights = Mapping[tuple[int, str], LoraWeights]  # an adapter's, by (layer, PEFT module name)
Shard = Callable[[Weights], Weights]  # what a rank keeps of an adapter's weights


@dataclass(frozen=True)
class ModuleSlots:
    """One module's weights in every slot, and the columns of its product's output it adds to."""

    a: torch.Tensor  # [in, slots, width]
    b: torch.Tensor  # [slots, width, out]
    columns: slice


class LoraSlots:
    """`count` slots of rank up to `max_rank` for the layers [first_layer, first_layer + num_layers)
    of `model` (a pipeline stage's, a tensor-parallel rank's shard), in `dtype` on `device`; `shard`:
    what this rank keeps of each adapter (None: all of it)."""

    def __init__(self, model: ModelConfig, count: int, max_rank: int, dtype: torch.dtype,
                 products: tuple[str, ...], shard: Shard | None = None, device: torch.device | str = "cpu") -> None:
        self.count = count
        self._shard = shard
        self.width = -(-max_rank // 8) * 8
        self.dtype = dtype
        self.device = torch.device(device)
        self.first_layer = model.first_layer
        self.ranks: list[int] = [0] * count  # 0: empty
        self.modules: dict[tuple[int, str], tuple[ModuleSlots, ...]] = {}
        for layer in range(model.first_layer, model.first_layer + model.num_layers):
            for product in products:
                start, parts = 0, []
                for module in PRODUCT_MODULES[product]:
                    out, inp = projection_shape(model, module)
                    parts.append(ModuleSlots(torch.zeros(inp, count, self.width, dtype=dtype, device=device),
                                             torch.zeros(count, self.width, out, dtype=dtype, device=device),
                                             slice(start, start + out)))
                    start += out
                self.modules[(layer, product)] = tuple(parts)

    def load(self, slot: int, rank: int, weights: Weights) -> None:
        """Put the adapter of `rank` and (whole) `weights` in `slot` (whatever it held is overwritten)."""
        self.clear(slot)
        if self._shard is not None:
            weights = self._shard(weights)
        for (layer, module), lora in weights.items():
            product = MODULES[module]
            if (layer, product) not in self.modules:
                continue  # a layer of another pipeline stage
            part = self.modules[(layer, product)][PRODUCT_MODULES[product].index(module)]
            part.a[:, slot, :rank].copy_(lora.a.T)
            part.b[slot, :rank].copy_(lora.b.T)
        self.ranks[slot] = rank

    def clear(self, slot: int) -> None:
        """Empty `slot`."""
        rank = self.ranks[slot]
        if rank:
            for parts in self.modules.values():
                for part in parts:
                    part.a[:, slot, :rank].zero_()
                    part.b[slot, :rank].zero_()
        self.ranks[slot] = 0
