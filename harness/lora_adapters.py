"""PEFT LoRA adapters with random weights, saved the way peft saves them, for a base of a given
shape: built by peft over a transformers Llama of that shape whose own weights are left unset (an
adapter's file holds none of them), `init_lora_weights=False` so that B is not zero and
an adapter changes what the model computes (a test could not fail otherwise)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_adapter(directory: Path, model: ModelConfig, rank: int, seed: int,
                 modules: tuple[str, ...] = MODULES) -> Path:
    """A random adapter of `rank` on `modules` of every layer of a base shaped as `model`, saved in `directory`."""
    config = LlamaConfig(vocab_size=16, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
                         num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
                         num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim)
    with torch.device("meta"):  # the base's weights are never saved: they need no memory filled
        base = LlamaForCausalLM(config)
    base = base.to_empty(device="cpu")
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(modules),
                                                 init_lora_weights=False))
    peft_model.save_pretrained(str(directory))
    return directory
