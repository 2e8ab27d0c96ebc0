"""Find model files (a GGUF file or an HF directory), read them, and build the model on a device."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.attention.metadata import AttentionBackend
from engine.attention.streaming import StreamingAttention
from engine.config import CpuWeights, ModelConfig
from engine.model.decode_stack import DecodeStack
from engine.model.gguf_loader import load_gguf
from engine.model.hf_loader import load_hf_dir
from engine.model.kernels import KERNEL_DTYPES, cpu_kernels
from engine.model.llama import LlamaForCausalLM, ModelPlan, Sharding
from engine.model.paths import default_model_path
from engine.model.product_plan import plan_table
from engine.model.quant_config import StoredFormat, check_requested
from engine.model.quantized import KeepWeight, QuantizedWeight
from engine.model.weight_formats import OWN_GROUPS, WeightFormat

log = logging.getLogger(__name__)

QuantizedAs = Literal["gguf", "gptq", "awq"]


@dataclass(frozen=True)
class ModelFiles:
    """A model's config and its HF-named weights: float tensors already in `dtype`, and a
    QuantizedWeight for each tensor the checkpoint stores in integer groups a loader maps (a GGUF
    file's blocks, a GPTQ or AWQ checkpoint's packed layers)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedWeight]
    source: str
    kind: Literal["gguf", "hf"]
    dtype: torch.dtype
    # The integer format of the checkpoint's QuantizedWeights, None when it has none.
    quantized_as: QuantizedAs | None = None
    # Tensors stored in integer blocks no loader maps, dequantized into `weights` (name -> block type).
    dequantized: dict[str, str] = field(default_factory=dict)

    @property
    def stored_format(self) -> StoredFormat:
        """What the checkpoint holds: GGUF blocks, float tensors, or GPTQ/AWQ packed layers."""
        if self.kind == "gguf":
            return "gguf"
        return self.quantized_as or "float"

    @property
    def quantized(self) -> dict[str, QuantizedWeight]:
        """The weights stored as integer groups, by HF name."""
        return {name: weight for name, weight in self.weights.items() if isinstance(weight, QuantizedWeight)}


def load_model_files(path: str | None, dtype: torch.dtype, quantization: str = "auto",
                     keep: KeepWeight | None = None) -> ModelFiles:
    """Read a .gguf file or an HF directory (config.json + *.safetensors); None means the shipped model.
    ValueError naming the flag, before the tensors are read, if `quantization` (--quantization) does
    not fit what the checkpoint holds. `keep` takes each tensor as it is read and returns the part to
    hold (a tensor-parallel rank's shard: engine.parallel.shard), so the whole model is never held."""
    source = default_model_path() if path is None else path
    if os.path.isdir(source):
        checkpoint = load_hf_dir(source, dtype, quantization, keep)
        method = None if checkpoint.quantization is None else checkpoint.quantization.method
        return ModelFiles(config=checkpoint.config, weights={**checkpoint.weights, **checkpoint.quantized},
                          source=source, kind="hf", dtype=dtype, quantized_as=method)
    if os.path.isfile(source) and source.endswith(".gguf"):
        check_requested(quantization, "gguf", source)
        config, gguf_weights, dequantized = load_gguf(source, dtype, keep)
        stored = "gguf" if any(isinstance(w, QuantizedWeight) for w in gguf_weights.values()) else None
        return ModelFiles(config=config, weights=gguf_weights, source=source, kind="gguf", dtype=dtype,
                          quantized_as=stored, dequantized=dequantized)
    if not os.path.exists(source):
        raise FileNotFoundError(f"model path {source!r} does not exist")
    raise ValueError(f"model path {source!r} is neither a .gguf file nor an HF model directory")


def build_model(files: ModelFiles, attention: AttentionBackend, device: str | torch.device,
                quantization: str = "none", cpu_weights: CpuWeights = "plain",
                dtype: torch.dtype | None = None, int8_parts: int = 0,
                sharding: Sharding | None = None) -> LlamaForCausalLM:
    """The model on `device`, in `dtype` (None: the files' own; tests share one fp32 load), its
    products built in the given weight format (engine.model.weight_formats) with dense weights
    prepared as `cpu_weights` says and, with `int8_parts`, integer-group products quantizing their
    inputs to that many int8 parts (engine.model.int8_activations); `sharding`: a tensor-parallel
    rank's (engine.parallel.collectives). Every product's plan is logged as a table. Serving a
    checkpoint's own integer groups, a warning names every tensor no kernel takes on this device
    (served dequantized). On CPU in fp32 and bf16 RMSNorm, the rotary embedding and SwiGLU's gating
    are the CPU kernels' ops where they build, and small decode batches of one rank run as one call
    (engine.model.decode_stack)."""
    dtype = dtype or files.dtype
    ops = cpu_kernels(device) if dtype in KERNEL_DTYPES else None
    # StreamingLLM's attention rotates q and k itself, at their positions within the cache.
    rotary_in_attention = isinstance(attention, StreamingAttention)
    plan = ModelPlan(sharding=sharding, rotary_in_attention=rotary_in_attention)
    if ops is not None:  # one op for each instead of torch's three to eight (121 in a batch-1 step)
        # A rank whose products join other ranks' or a pipeline stage's layers run one by one.
        whole = sharding is None and files.config.stage is None
        stack = functools.partial(DecodeStack.build, ops=ops) if whole else None
        plan = ModelPlan(ops.rms_norm, ops.rotary, ops.silu_mul, stack, sharding, rotary_in_attention, ops.lora_add_)
    with torch.device(device):
        model = LlamaForCausalLM(files.config, attention, plan)
    model.to(dtype=dtype)
    formats = WeightFormat(quantization, dtype, device, cpu_weights, int8_parts, ops)
    model.load_weights(files.weights, formats)
    stacked = model.stacked.max_rows if isinstance(model.stacked, DecodeStack) else 0
    log.info("product plan (dtype %s, quantization %s, cpu_weights %s%s):\n%s", str(dtype).removeprefix("torch."),
             quantization, cpu_weights, f", kernels {ops.describe()}" if ops is not None else "",
             plan_table(formats.plans, stacked))
    if quantization in OWN_GROUPS:
        unserved = {**files.dequantized, **{name: "groups no kernel takes here" for name in formats.dequantized}}
        if unserved:
            log.warning("quantization %s: no kernel serves these tensors' integer groups on %s, so they are served "
                        "dequantized to %s: %s", quantization, torch.device(device).type,
                        str(dtype).removeprefix("torch."),
                        ", ".join(f"{name} ({kind})" for name, kind in sorted(unserved.items())))
    return model.eval()
