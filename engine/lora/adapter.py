"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`), read and checked
against the base model it is to serve on.

LoRA adds to a projection y = x·Wᵀ the low-rank term s·(x·Aᵀ)·Bᵀ, A [r, in], B [out, r], with
s = lora_alpha / r (lora_alpha / √r under rsLoRA). The scale is folded into B here, once, so a
step's product is two plain matrix products per adapter.

What is served: LoRA (not DoRA) on q, k, v, o, gate, up and down of a Llama-family layer, without
trained biases or fully trained modules, one rank and alpha for every module. Anything else is
refused with `AdapterError`, naming the adapter and the reason, rather than served differently from
what it was trained as: an adapter for another base shows as a layer or module this model lacks
or a tensor of another shape.

An adapter's identity (`fingerprint`) is a hash of what it computes (scale folded in), not of its
name: the KV it produces is the same under any name, and a different adapter under a reused name
is a different identity.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names of the projections the engine serves, by the engine's product they add to.
MODULES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
           "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
# base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter name}].weight
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                     r"\.lora_([AB])(?:\.\w+)?\.weight$")
# Config fields whose non-default value changes what the adapter computes in a way not served.
_UNSERVED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
             "rank_pattern": {}, "alpha_pattern": {}, "use_qalora": False, "lora_bias": False}


class AdapterError(ValueError):
    """An adapter that cannot be served on this base; the message names the adapter and the reason."""


@dataclass(frozen=True)
class LoraWeights:
    """One projection's low-rank update: `a` [rank, in] and `b` [out, rank], the scale folded into `b`."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter checked against its base: its rank and, by (layer, PEFT module name), its weights."""

    name: str
    path: Path
    rank: int
    weights: dict[tuple[int, str], LoraWeights]
    fingerprint: bytes  # 16 bytes over what it computes (engine.kv_cache.block_hash takes it)

    @property
    def modules(self) -> frozenset[str]:
        """The PEFT module names it adapts (in some layer)."""
        return frozenset(module for _, module in self.weights)


def projection_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a PEFT module's projection on `model`."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    hidden, inter = model.hidden_size, model.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[module]


def load_adapter(name: str, path: Path, model: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """The adapter in directory `path`, served as `name` on `model`, its weights in `dtype`.
    AdapterError naming `name` and the reason if it cannot be served."""
    def fail(reason: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {reason}")

    config = _read_config(path, fail)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise fail(f"{CONFIG_FILE}: r must be a positive integer and lora_alpha a number (r={rank!r}, "
                   f"lora_alpha={alpha!r})")
    if rank > max_rank:
        raise fail(f"rank {rank} is above --max-lora-rank {max_rank}")
    for field, default in _UNSERVED.items():
        if config.get(field, default) not in (default, None, False, {}, []):
            raise fail(f"{CONFIG_FILE}: {field}={config[field]!r} is not served")
    targets = config.get("target_modules")
    named = [targets] if isinstance(targets, str) else list(targets or [])
    unsupported = sorted(t for t in named if t not in MODULES and not _is_pattern(t))
    if unsupported:
        raise fail(f"target module(s) {', '.join(unsupported)} not served (served: {', '.join(MODULES)})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(path, fail, model, rank, scale, dtype)
    if not weights:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(name, path, rank, weights, _fingerprint(weights))


def _read_config(path: Path, fail: Any) -> dict[str, Any]:
    if not path.is_dir():
        raise fail("not a directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise fail(f"no {CONFIG_FILE}") from None
    except json.JSONDecodeError as error:
        raise fail(f"{CONFIG_FILE} is not JSON: {error}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise fail(f"{CONFIG_FILE}: peft_type {config.get('peft_type') if isinstance(config, dict) else None!r} "
                   "is not LORA")
    return config


def _read_weights(path: Path, fail: Any, model: ModelConfig, rank: int, scale: float,
                  dtype: torch.dtype) -> dict[tuple[int, str], LoraWeights]:
    try:
        tensors = load_file(path / WEIGHTS_FILE)
    except FileNotFoundError:
        raise fail(f"no {WEIGHTS_FILE} (a .bin adapter is not read: convert it to safetensors)") from None
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise fail(f"{WEIGHTS_FILE} cannot be read: {error}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR.match(tensor_name)
        if match is None:
            raise fail(f"tensor {tensor_name} is not a LoRA weight of a Llama-family layer's projection "
                       "(an adapter for another architecture, or of a module not served)")
        layer, block, module, part = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or (block == "mlp") != module.endswith(("gate_proj", "up_proj", "down_proj")):
            raise fail(f"target module {block}.{module} not served (served: {', '.join(MODULES)})")
        if layer >= model.num_layers:
            raise fail(f"tensor {tensor_name}: layer {layer}, but the base has {model.num_layers} layers")
        if block == "mlp" and model.moe is not None:
            raise fail(f"{module} on a mixture-of-experts base ({model.name}) is not served")
        parts.setdefault((layer, module), {})[part] = tensor
    weights = {}
    for (layer, module), pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise fail(f"layer {layer} {module}: lora_A and lora_B must both be present")
        out, inp = projection_shape(model, module)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise fail(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                       f"base's {out}x{inp} projection at rank {rank} (an adapter for another base?)")
        weights[(layer, module)] = LoraWeights(a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    return weights


def _is_pattern(target: str) -> bool:
    """Whether a target_modules entry is a regular expression (PEFT matches it against full module
    names) rather than a module name: the tensors present then say which modules it chose."""
    return any(ch in target for ch in r".*+?[]()|\^$")


def _fingerprint(weights: dict[tuple[int, str], LoraWeights]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for (layer, module), lora in sorted(weights.items()):
        digest.update(f"{layer}.{module}".encode())
        for tensor in (lora.a, lora.b):
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()
