"""Read an HF model directory (config.json + safetensors, sharded or not) into a ModelConfig and weights:
float tensors in the model's dtype, and GPTQ/AWQ layers as QuantizedWeights (engine.model.gptq_awq)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig, MoEConfig, RopeScaling
from engine.model.gptq_awq import take_quantized
from engine.model.quant_config import CheckpointQuantization, check_requested, read_checkpoint_quantization
from engine.model.quantized import KeepWeight, QuantizedWeight

_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # a bias on q/k/v, never on o
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Every layer windowed alike; Qwen's configs window only the layers from max_window_layers on.
_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM")
# Mixtral's checkpoint names for its MoE tensors; the model reads Qwen-MoE's ("mlp.gate", "mlp.experts.E.gate_proj").
_MIXTRAL_NAMES = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_SHARD_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFCheckpoint:
    """An HF directory's config and tensors under their HF names: `weights` in the requested dtype,
    `quantized` the packed layers (none for a float checkpoint), as `quantization` describes them."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedWeight]
    quantization: CheckpointQuantization | None


def load_hf_dir(path: str, dtype: torch.dtype, requested: str = "auto", keep: KeepWeight | None = None) -> HFCheckpoint:
    """Config from config.json, then every safetensors tensor. ValueError naming the flag if
    `requested` (--quantization) contradicts the checkpoint's quantization_config (checked before
    any tensor is read), or naming the tensor or field the checkpoint gets wrong. With `keep`, each
    tensor is the part of it `keep(config, name, tensor)` returns: a float checkpoint's taken as it
    is read (the whole model is never held), a GPTQ/AWQ one's once its packed layers are unpacked
    (they are read whole: their integer groups are a quarter of the float size)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as file:
        raw = json.load(file)
    config = config_from_hf(raw, name=os.path.basename(os.path.normpath(path)))
    quantization = read_checkpoint_quantization(raw, path)
    check_requested(requested, "float" if quantization is None else quantization.method, path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(path):
        with safe_open(shard, framework="pt") as file:
            for stored in file.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                tensor = file.get_tensor(stored)
                name = model_tensor_name(stored)
                if keep is not None and quantization is None:
                    held = keep(config, name, tensor.to(dtype))
                    if held is None:
                        continue
                    tensor = held
                tensors[name] = tensor
    quantized = {} if quantization is None else take_quantized(tensors, quantization)
    weights = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    if keep is not None and quantization is not None:  # packed layers are cut once unpacked
        quantized = {name: held for name, weight in quantized.items()
                     if (held := keep(config, name, weight)) is not None}
        weights = {name: held for name, weight in weights.items() if (held := keep(config, name, weight)) is not None}
    # Old Llama checkpoints carry RoPE buffers; tied checkpoints may still store the head (transformers
    # ignores it and ties), so neither is a weight this model has.
    for name in [n for n in weights if n.endswith("rotary_emb.inv_freq")]:
        del weights[name]
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        if "lm_head.weight" in quantized:
            raise ValueError("lm_head.qweight: a packed LM head on a model with tie_word_embeddings is not supported")
    _drop_zero_biases(weights, quantized, config)
    return HFCheckpoint(config, weights, quantized, quantization)


def model_tensor_name(name: str) -> str:
    """The name the model reads a checkpoint tensor under: Mixtral's MoE tensors renamed, every other as stored."""
    match = _MIXTRAL_NAMES.fullmatch(name)
    if match is None:
        return name
    layer, part = match.groups()
    if part == "gate":
        return f"{layer}mlp.gate.weight"
    _, expert, which = part.split(".")
    return f"{layer}mlp.experts.{expert}.{_MIXTRAL_EXPERT[which]}.weight"


def _drop_zero_biases(weights: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight],
                      config: ModelConfig) -> None:
    # Some GPTQ exporters store a zero bias for every packed layer; as vLLM does, the ones this model
    # has no bias for are skipped (a zero bias changes nothing; any other is left to be refused).
    biased = ("q_proj", "k_proj", "v_proj") if config.attention_bias else ()
    for name in quantized:
        prefix = name.removesuffix(".weight")
        bias = weights.get(f"{prefix}.bias")
        if bias is not None and not prefix.endswith(biased) and not bool(bias.any()):
            del weights[f"{prefix}.bias"]


def safetensors_files(path: str) -> list[str]:
    """The weight files of an HF directory (a sharded one's from its index); ValueError when none."""
    index_path = os.path.join(path, _SHARD_INDEX)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as file:
            shards = sorted(set(json.load(file)["weight_map"].values()))
    else:
        shards = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{path}: no *.safetensors weights")
    return [os.path.join(path, shard) for shard in shards]


def config_from_hf(raw: dict[str, Any], name: str = "model") -> ModelConfig:
    """ModelConfig from a config.json dict; ValueError for architectures or features this engine lacks."""
    architectures = raw.get("architectures") or []
    if not architectures or architectures[0] not in _ARCHITECTURES:
        raise ValueError(f"unsupported architectures {architectures!r}; supported: {', '.join(_ARCHITECTURES)}")
    architecture = architectures[0]
    qkv_bias = architecture in _QKV_BIAS and bool(raw.get("qkv_bias", True))
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: unsupported {raw['hidden_act']!r} (only 'silu')")
    if raw.get("mlp_bias", False):
        raise ValueError("mlp_bias: unsupported")
    if architecture not in _QKV_BIAS and raw.get("attention_bias", False):
        raise ValueError(f"attention_bias: unsupported for {architecture} (it includes an o_proj bias)")
    max_positions = int(raw["max_position_embeddings"])
    window = _sliding_window(raw, architecture, max_positions)
    num_heads = int(raw["num_attention_heads"])
    rope_params = _rope_parameters(raw)
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        rope_scaling=_rope_scaling(rope_params, max_positions),
        bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        name=name,
        qk_norm=architecture in _QK_NORM,
        moe=_moe_config(raw, architecture),
        architecture=architecture,
        sliding_window=window,
    )


def _moe_config(raw: dict[str, Any], architecture: str) -> MoEConfig | None:
    """The MoE MLP of a Mixtral, Qwen2-MoE or Qwen3-MoE config; ValueError naming a variant not served."""
    if architecture == "MixtralForCausalLM":
        return MoEConfig(num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
                         intermediate_size=int(raw["intermediate_size"]), normalize_top_k=True)
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    # Dense layers among the sparse ones (Qwen's mlp_only_layers, decoder_sparse_step > 1) are not served.
    if raw.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers: unsupported {raw['mlp_only_layers']!r} (every layer must be sparse)")
    if int(raw.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"decoder_sparse_step: unsupported {raw['decoder_sparse_step']} (only 1)")
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
                     top_k=int(raw["num_experts_per_tok"]), intermediate_size=int(raw["moe_intermediate_size"]),
                     normalize_top_k=bool(raw.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                     shared_gate=shared > 0)


def _sliding_window(raw: dict[str, Any], architecture: str, max_positions: int) -> int | None:
    """The window every layer attends through, or None for full attention; ValueError for a
    window on only some layers (Qwen2's max_window_layers), which is not served."""
    window = raw.get("sliding_window")
    enabled = raw.get("use_sliding_window", True)
    # A window at least as long as the context never hides a token, so full attention is exact.
    if not enabled or window is None or int(window) >= max_positions:
        return None
    if architecture not in _WINDOWED:
        raise ValueError(f"sliding_window: unsupported for {architecture} ({window} < max_position_embeddings="
                         f"{max_positions}; served for {', '.join(_WINDOWED)})")
    return int(window)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older configs use `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor: unsupported")
    return params


def _rope_scaling(params: dict[str, Any], max_positions: int) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type: unsupported {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}")
    if rope_type == "default":
        return None
    defaults = RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        # transformers falls back to the config's own context length for llama3.
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_positions)),
    )
