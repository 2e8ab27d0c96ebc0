"""Find model files (a GGUF file or an HF directory), read them, and build the model on a device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.attention.metadata import AttentionBackend
from engine.config import CpuWeights, ModelConfig
from engine.model.gguf_loader import load_gguf
from engine.model.hf_loader import load_hf_dir
from engine.model.llama import LlamaForCausalLM
from engine.model.paths import default_model_path
from engine.model.quantized import QuantizedWeight
from engine.model.weight_formats import WeightFormat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """A model's config and its HF-named weights: float tensors already in `dtype`, and a
    QuantizedWeight for each tensor the checkpoint stores in integer groups a loader maps."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedWeight]
    source: str
    kind: Literal["gguf", "hf"]
    dtype: torch.dtype
    # The integer format the checkpoint's QuantizedWeights are in ("gguf"), None for float weights.
    quantized_as: str | None = None
    # Tensors stored in integer blocks no loader maps, dequantized into `weights` (name -> block type).
    dequantized: dict[str, str] = field(default_factory=dict)


def load_model_files(path: str | None, dtype: torch.dtype) -> ModelFiles:
    """Read a .gguf file or an HF directory (config.json + *.safetensors); None means the shipped model."""
    source = default_model_path() if path is None else path
    if os.path.isdir(source):
        config, weights = load_hf_dir(source, dtype)
        return ModelFiles(config=config, weights=dict(weights), source=source, kind="hf", dtype=dtype)
    if os.path.isfile(source) and source.endswith(".gguf"):
        config, gguf_weights, dequantized = load_gguf(source, dtype)
        stored = "gguf" if any(isinstance(w, QuantizedWeight) for w in gguf_weights.values()) else None
        return ModelFiles(config=config, weights=gguf_weights, source=source, kind="gguf", dtype=dtype,
                          quantized_as=stored, dequantized=dequantized)
    if not os.path.exists(source):
        raise FileNotFoundError(f"model path {source!r} does not exist")
    raise ValueError(f"model path {source!r} is neither a .gguf file nor an HF model directory")


def build_model(files: ModelFiles, attention: AttentionBackend, device: str | torch.device,
                quantization: str = "none", cpu_weights: CpuWeights = "plain") -> LlamaForCausalLM:
    """The model on `device`, in the files' dtype, its products built in the given weight format
    (engine.model.weight_formats) with dense weights prepared as `cpu_weights` says. Under "gguf",
    a warning names every tensor whose integer blocks no kernel takes (served dequantized)."""
    with torch.device(device):
        model = LlamaForCausalLM(files.config, attention)
    model.to(dtype=files.dtype)
    formats = WeightFormat(quantization, files.dtype, device, cpu_weights)
    model.load_weights(files.weights, formats)
    if quantization == "gguf":
        unserved = {**files.dequantized, **{name: "groups no kernel takes" for name in formats.dequantized}}
        if unserved:
            log.warning("quantization gguf: no kernel serves these tensors' blocks, so they are served dequantized "
                        "to %s: %s", str(files.dtype).removeprefix("torch."),
                        ", ".join(f"{name} ({kind})" for name, kind in sorted(unserved.items())))
    return model.eval()
