"""Read a llama-architecture GGUF file into a ModelConfig and HF-named weights: the file's integer
blocks as QuantizedWeights where engine.model.gguf_blocks maps them, every other tensor as a float tensor."""

from __future__ import annotations

import os
import re

import numpy as np
import torch
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeScaling
from engine.model.gguf_blocks import FLOAT_TYPES, as_quantized, permute_rows
from engine.model.gguf_file import GGUFFile, gguf_reader
from engine.model.quantized import KeepWeight, QuantizedWeight, Weight

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_MISSING = object()


def load_gguf(path: str, dtype: torch.dtype, keep: KeepWeight | None = None) -> tuple[
        ModelConfig, dict[str, torch.Tensor | QuantizedWeight], dict[str, str]]:
    """Config from the llama.* / tokenizer.ggml.* metadata; every tensor under its HF name, as a
    QuantizedWeight for the block types gguf_blocks maps, else dequantized to `dtype` (with `keep`,
    the part of it `keep(config, name, tensor)` returns, taken before the next tensor is read); and
    the tensors stored in other block types (HF name -> block type), which no kernel serves."""
    reader = gguf_reader(path)
    config = gguf_model_config(reader, path)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    dequantized: dict[str, str] = {}
    for tensor in reader.tensors:
        # GGUF lists dimensions fastest-first; numpy (and torch) order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        name = hf_tensor_name(tensor.name)
        heads = _rope_heads(tensor.name, config)
        blocks = as_quantized(tensor.data, tensor.tensor_type, shape) if len(shape) == 2 else None  # type: ignore[arg-type]
        weight: Weight
        if blocks is not None:
            weight = blocks if heads is None else permute_rows(blocks, _rope_row_order(shape[0], heads))
        else:
            if tensor.tensor_type not in FLOAT_TYPES:
                dequantized[name] = tensor.tensor_type.name
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            if heads is not None:
                array = array[_rope_row_order(shape[0], heads)]
            weight = _to_tensor(array, dtype)
        held = weight if keep is None else keep(config, name, weight)
        if held is not None:
            weights[name] = held
    return config, weights, dequantized


def _rope_heads(gguf_name: str, config: ModelConfig) -> int | None:
    # llama.cpp's converter interleaves each head's rows for adjacent-pair RoPE; HF rotates halves.
    if gguf_name.endswith("attn_q.weight"):
        return config.num_heads
    if gguf_name.endswith("attn_k.weight"):
        return config.num_kv_heads
    return None


def hf_tensor_name(gguf_name: str) -> str:
    """The HF parameter name of a llama GGUF tensor; ValueError for tensors this model does not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"


def _to_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # Unquantized tensors come back as read-only views of the memory-mapped file; torch needs owned memory.
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = array.copy()
    return torch.from_numpy(array).to(dtype)


def _rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Row i of the HF weight is row order[i] of the GGUF one: within each head, the even rows then the odd ones."""
    head_dim = rows // num_heads
    return np.arange(rows).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(rows)


class _Metadata:
    """Typed access to GGUF key/value metadata, with errors that name the file and key."""

    def __init__(self, reader: GGUFFile, path: str) -> None:
        self._reader = reader
        self._path = path

    def get(self, key: str, default: object = _MISSING) -> object:
        entry = self._reader.get(key)
        if entry is not None:
            return entry
        if default is _MISSING:
            raise ValueError(f"{self._path}: GGUF metadata lacks {key}")
        return default

    def as_int(self, key: str, default: object = _MISSING) -> int:
        return int(str(self.get(key, default)))

    def as_float(self, key: str, default: object = _MISSING) -> float:
        return float(str(self.get(key, default)))

    def optional_int(self, key: str) -> int | None:
        value = self.get(key, None)
        return None if value is None else int(str(value))


def gguf_model_config(reader: GGUFFile, path: str) -> ModelConfig:
    """The model's config from the llama.* / tokenizer.ggml.* metadata (no tensor is read); ValueError
    naming what this engine cannot serve."""
    tied = "output.weight" not in {tensor.name for tensor in reader.tensors}
    meta = _Metadata(reader, path)
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{path}: unsupported GGUF architecture {architecture!r} (only 'llama')")
    hidden_size = meta.as_int("llama.embedding_length")
    num_heads = meta.as_int("llama.attention.head_count")
    head_dim = meta.as_int("llama.attention.key_length", hidden_size // num_heads)
    rotary_dim = meta.as_int("llama.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embedding ({rotary_dim} of {head_dim} dims) is unsupported")
    eos_ids = (meta.optional_int("tokenizer.ggml.eos_token_id"), meta.optional_int("tokenizer.ggml.eot_token_id"))
    vocab_fallback = len(reader.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        vocab_size=meta.as_int("llama.vocab_size", vocab_fallback),
        hidden_size=hidden_size,
        intermediate_size=meta.as_int("llama.feed_forward_length"),
        num_layers=meta.as_int("llama.block_count"),
        num_heads=num_heads,
        num_kv_heads=meta.as_int("llama.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta.as_float("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.as_float("llama.rope.freq_base", 10000.0),
        max_position_embeddings=meta.as_int("llama.context_length"),
        tie_word_embeddings=tied,
        rope_scaling=_rope_scaling(
            str(meta.get("llama.rope.scaling.type", "none")), meta.as_float("llama.rope.scaling.factor", 1.0), path
        ),
        bos_token_id=meta.optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        name=str(meta.get("general.name", os.path.splitext(os.path.basename(path))[0])),
    )


def _rope_scaling(kind: str, factor: float, path: str) -> RopeScaling | None:
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    raise ValueError(f"{path}: unsupported GGUF rope scaling {kind!r}")
