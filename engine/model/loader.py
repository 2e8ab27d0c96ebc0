"""Find model files (a GGUF file or an HF directory), read them, and build the model on a device."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from engine.attention.metadata import AttentionBackend
from engine.config import ModelConfig
from engine.model.gguf_loader import load_gguf
from engine.model.hf_loader import load_hf_dir
from engine.model.llama import LlamaForCausalLM
from engine.model.paths import default_model_path


@dataclass(frozen=True)
class ModelFiles:
    """A model's config and its HF-named weights, already in the dtype the model will run in."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    source: str
    kind: Literal["gguf", "hf"]


def load_model_files(path: str | None, dtype: torch.dtype) -> ModelFiles:
    """Read a .gguf file or an HF directory (config.json + *.safetensors); None means the shipped model."""
    source = default_model_path() if path is None else path
    if os.path.isdir(source):
        config, weights = load_hf_dir(source, dtype)
        return ModelFiles(config=config, weights=weights, source=source, kind="hf")
    if os.path.isfile(source) and source.endswith(".gguf"):
        config, weights = load_gguf(source, dtype)
        return ModelFiles(config=config, weights=weights, source=source, kind="gguf")
    if not os.path.exists(source):
        raise FileNotFoundError(f"model path {source!r} does not exist")
    raise ValueError(f"model path {source!r} is neither a .gguf file nor an HF model directory")


def build_model(files: ModelFiles, attention: AttentionBackend, device: str | torch.device,
                dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """The model on `device`, in `dtype` (None: the loaded weights' own), with those weights copied in."""
    with torch.device(device):
        model = LlamaForCausalLM(files.config, attention)
    model.to(dtype=dtype or files.weights["model.embed_tokens.weight"].dtype)
    model.load_weights(files.weights)
    return model.eval()
