"""An engine's LoRA adapters, set up at start-up (`--enable-lora`): the slots the model runner holds,
the model's products wrapped to add them, and the registry the scheduler gives slots from.

Refused at start-up, naming the flag and the model, where the adapters' products would not be
what the layout computes: several processes (each rank would need its shard of A and B) and
speculative decoding (the drafts would run without the request's adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.lora.adapter import LoraAdapter, load_adapter
from engine.lora.product import LoraProduct
from engine.lora.registry import AdapterRegistry, Reader
from engine.lora.slots import LoraSlots
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
                   dtype: torch.dtype) -> ServedAdapters | None:
    """The engine's adapters (None without `config.lora`), its model's products wrapped for them and
    the adapters of `config.lora.modules` read. ValueError naming the flag for a layout not served;
    AdapterError for a start-up adapter that cannot be served."""
    lora = config.lora
    if lora is None:
        return None
    if config.world_size > 1:
        split = ", ".join(f"--{name.replace('_', '-')} {size}" for name, size in config.parallel_sizes.items()
                          if size > 1)
        raise ValueError(f"enable_lora: not served over several processes yet ({split}; model {model_config.name}): "
                         "each rank would need its shard of every adapter and the step's rows by adapter")
    if config.speculative is not None:
        raise ValueError(f"enable_lora: not served with speculative_config (model {model_config.name}): "
                         "the drafts would run without the request's adapter")
    slots = LoraSlots(model_config, lora.max_loras, lora.max_lora_rank, dtype, tuple(model.layers[0].linears))
    attach_lora(model, slots)

    def read(name: str, path: Path) -> LoraAdapter:
        return load_adapter(name, path, model_config, lora.max_lora_rank, dtype)

    served = ServedAdapters(AdapterRegistry(lora, read), slots, read, config.served_name)
    for name, path in lora.modules:
        served.registry.serve(served.read(name, Path(path)))
    return served


def attach_lora(model: LlamaForCausalLM, slots: LoraSlots) -> None:
    """Wrap each of the loaded model's layer products so that they add the LoRA terms of the slots
    in the model's `lora_step` (its layers start at `slots.first_layer`)."""
    for index, layer in enumerate(model.layers, start=slots.first_layer):
        for product, base in list(layer.linears.items()):
            layer.linears[product] = LoraProduct(base, slots.modules[(index, product)], slots.ranks, model.lora_step)
