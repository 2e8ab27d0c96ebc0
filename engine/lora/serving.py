"""An engine's LoRA adapters, set up at start-up (`--enable-lora`): the slots the model runner holds,
the model's products wrapped to add them, and the registry the scheduler gives slots from.

Under tensor parallelism every rank holds slots of its part of each product and keeps its part of
each adapter (engine.parallel.adapter_shard); a pipeline stage's ranks, of its layers. Rank 0 sends
the others each adapter it loads and each step's slot per sequence with the step's plan
(engine.parallel.step_plan; a stage takes its micro-batches' rows from it). Refused at start-up,
naming the flag and the model, where the adapters' products would not be what the layout computes:
prefill context-parallel ranks (a split prompt's slices would run without the adapter) and
speculative decoding (the drafts would run without the request's adapter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig, LoraConfig, ModelConfig
from engine.lora.adapter import LoraAdapter, load_adapter
from engine.lora.product import LoraProduct
from engine.lora.registry import AdapterRegistry, Reader
from engine.lora.slots import LoraSlots, Shard
from engine.lora.states import adapter_states

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM
    from engine.scheduler import Scheduler


@dataclass(frozen=True)
class ServedAdapters:
    """The adapters of one engine: the scheduler's registry, the runner's slots, and how an adapter
    is read and checked against the base (`read`: any thread, it touches neither)."""

    registry: AdapterRegistry
    slots: LoraSlots
    reader: Reader
    model_name: str  # the served model's name, which requests give as `model` too

    def read(self, name: str, path: Path) -> LoraAdapter:
        """The adapter in `path`, checked to serve as `name` (on any thread, so that a worker reads
        files off its engine's); AdapterError or ValueError naming it if it cannot be."""
        if not name:
            raise ValueError("lora_name: an adapter needs a name")
        if name == self.model_name:
            raise ValueError(f"lora_name: {name!r} is the served model's name; adapters share its namespace")
        return self.reader(name, path)

    def stats(self, scheduler: Scheduler) -> dict[str, Any]:
        """The EngineStats fields of the adapters: each one's state, and the slots of a step."""
        states = adapter_states(self.registry, scheduler.requests.values(), scheduler.running)
        return {"lora_adapters": states, "max_loras": self.registry.config.max_loras}


def serve_adapters(config: EngineConfig, model: LlamaForCausalLM, model_config: ModelConfig,
                   dtype: torch.dtype, shard: Shard | None = None) -> ServedAdapters | None:
    """The engine's adapters (None without `config.lora`), its model's products wrapped for them and
    the adapters of `config.lora.modules` read; `shard`: what this rank keeps of each adapter (a
    tensor-parallel engine's: engine.parallel.adapter_shard). ValueError naming the flag for a
    layout not served; AdapterError for a start-up adapter that cannot be served."""
    lora = config.lora
    if lora is None:
        return None
    if config.prefill_context_parallel_size > 1:
        raise ValueError(f"enable_lora: not served over context-parallel ranks yet (--prefill-context-parallel-size "
                         f"{config.prefill_context_parallel_size}; model {model_config.name}): a split prompt's "
                         "slices would run without the request's adapter")
    if config.speculative is not None:
        raise ValueError(f"enable_lora: not served with speculative_config (model {model_config.name}): "
                         "the drafts would run without the request's adapter")
    slots = attach_slots(model, lora, dtype, shard)

    def read(name: str, path: Path) -> LoraAdapter:
        return load_adapter(name, path, model_config, lora.max_lora_rank, dtype)

    served = ServedAdapters(AdapterRegistry(lora, read), slots, read, config.served_name)
    for name, path in lora.modules:
        served.registry.serve(served.read(name, Path(path)))
    return served


def attach_slots(model: LlamaForCausalLM, lora: LoraConfig, dtype: torch.dtype, shard: Shard | None) -> LoraSlots:
    """The slots of `model` (one rank's: its config is its shard's), its products wrapped to add them."""
    slots = LoraSlots(model.config, lora.max_loras, lora.max_lora_rank, dtype, tuple(model.layers[0].linears), shard,
                      model.norm.device)
    attach_lora(model, slots)
    return slots


def attach_lora(model: LlamaForCausalLM, slots: LoraSlots) -> None:
    """Wrap each of the loaded model's layer products so that they add the LoRA terms of the slots
    in the model's `lora_step` (its layers start at `slots.first_layer`). A tensor-parallel rank's
    row-parallel products add theirs to the partial sum, before its all-reduce (one term per rank
    over its input features: engine.parallel.adapter_shard)."""
    sharding = model.plan.sharding
    model.lora_step.attach(slots, model.plan.lora_add)
    for index, layer in enumerate(model.layers, start=slots.first_layer):
        for product, base in list(layer.linears.items()):
            wrap = functools.partial(LoraProduct, modules=slots.modules[(index, product)], ranks=slots.ranks,
                                     step=model.lora_step)
            layer.linears[product] = wrap(base) if sharding is None else sharding.wrap_partial(base, wrap)
