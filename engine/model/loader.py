"""Find model files (a GGUF file or an HF directory), read them, and build the model on a device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.attention.metadata import AttentionBackend
from engine.config import ModelConfig
from engine.model.gguf_loader import load_gguf
from engine.model.hf_loader import load_hf_dir
from engine.model.llama import LlamaForCausalLM
from engine.model.paths import default_model_path
from engine.model.quant_config import QuantMethod, StoredFormat, check_requested
from engine.model.quantized import QuantizedWeight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """A model's config and its HF-named weights: float ones already in the dtype the model will run
    in, and the layers a GPTQ or AWQ checkpoint stores packed (`quant_method`) as QuantizedWeights."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    source: str
    kind: Literal["gguf", "hf"]
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    quant_method: QuantMethod | None = None

    @property
    def stored_format(self) -> StoredFormat:
        """What the checkpoint holds: GGUF blocks, float tensors, or GPTQ/AWQ packed layers."""
        if self.kind == "gguf":
            return "gguf"
        return self.quant_method or "float"


def load_model_files(path: str | None, dtype: torch.dtype, quantization: str = "auto") -> ModelFiles:
    """Read a .gguf file or an HF directory (config.json + *.safetensors); None means the shipped model.
    ValueError naming the flag, before the tensors are read, if `quantization` (--quantization) does
    not fit what the checkpoint holds."""
    source = default_model_path() if path is None else path
    if os.path.isdir(source):
        checkpoint = load_hf_dir(source, dtype, quantization)
        method = None if checkpoint.quantization is None else checkpoint.quantization.method
        return ModelFiles(config=checkpoint.config, weights=checkpoint.weights, source=source, kind="hf",
                          quantized=checkpoint.quantized, quant_method=method)
    if os.path.isfile(source) and source.endswith(".gguf"):
        check_requested(quantization, "gguf", source)
        config, weights = load_gguf(source, dtype)
        return ModelFiles(config=config, weights=weights, source=source, kind="gguf")
    if not os.path.exists(source):
        raise FileNotFoundError(f"model path {source!r} does not exist")
    raise ValueError(f"model path {source!r} is neither a .gguf file nor an HF model directory")


def build_model(files: ModelFiles, attention: AttentionBackend, device: str | torch.device,
                dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """The model on `device`, in `dtype` (None: the loaded weights' own), with those weights copied in."""
    dtype = dtype or files.weights["model.embed_tokens.weight"].dtype
    with torch.device(device):
        model = LlamaForCausalLM(files.config, attention)
    model.to(dtype=dtype)
    model.load_weights(_float_weights(files, dtype))
    return model.eval()


def _float_weights(files: ModelFiles, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if not files.quantized:
        return files.weights
    # The model's products take float weights only, so packed layers are served as the exact
    # weights they encode, at the model's dtype.
    log.warning("%s: %d %s layers dequantized to %s at load (no %s kernel yet)", files.source,
                len(files.quantized), files.quant_method, str(dtype).removeprefix("torch."), files.quant_method)
    return files.weights | {name: weight.dequantize().to(dtype) for name, weight in files.quantized.items()}
