"""An engine's LoRA adapters, set up at start-up (`--enable-lora`): the slots the model runner holds,
the model's products wrapped to add them, and the registry the scheduler gives slots from.

Refused at start-up, naming the flag and the model, where the adapters' products would not be
what the layout computes: several processes (each rank would need its shard of A and B) and
speculative decoding (the drafts would run without the request's adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.lora.adapter import LoraAdapter, load_adapter
from engine.lora.product import attach_lora
from engine.lora.registry import AdapterRegistry
from engine.lora.slots import LoraSlots
from engine.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ServedAdapters:
    """The adapters of one engine: the scheduler's registry and the runner's slots."""

    registry: AdapterRegistry
    slots: LoraSlots


def serve_adapters(config: EngineConfig, model: LlamaForCausalLM, model_config: ModelConfig,
                   dtype: torch.dtype) -> ServedAdapters | None:
    """The engine's adapters (None without `config.lora`), its model's products wrapped for them and
    the adapters of `config.lora.modules` read. ValueError naming the flag for a layout not served;
    AdapterError for a start-up adapter that cannot be served."""
    lora = config.lora
    if lora is None:
        return None
    if config.world_size > 1:
        raise ValueError(f"enable_lora: not served with a world of {config.world_size} processes "
                         f"(model {model_config.name}): {config.parallel_sizes}")
    if config.speculative is not None:
        raise ValueError(f"enable_lora: not served with speculative_config (model {model_config.name}): "
                         "the drafts would run without the request's adapter")
    slots = LoraSlots(model_config, lora.max_loras, lora.max_lora_rank, dtype, tuple(model.layers[0].linears))
    attach_lora(model, slots)

    def read(name: str, path: Path) -> LoraAdapter:
        return load_adapter(name, path, model_config, lora.max_lora_rank, dtype)

    return ServedAdapters(AdapterRegistry(lora, read), slots)
