"""Read a GGUF file of a Llama-family model (engine.model.gguf_names lists the architectures, dense and
mixture-of-experts) into a ModelConfig and HF-named weights: the file's integer blocks as
QuantizedWeights where engine.model.gguf_blocks maps them, every other tensor as a float tensor, and
a tensor stacking every expert's weight as one weight per expert."""

from __future__ import annotations

import os

import numpy as np
import torch
from gguf import ExpertGatingFuncType
from gguf.quants import dequantize

from engine.config import ModelConfig, MoEConfig, RopeScaling
from engine.model.gguf_blocks import FLOAT_TYPES, as_quantized, permute_rows
from engine.model.gguf_file import GGUFFile, GGUFTensor, gguf_reader
from engine.model.gguf_names import ARCHITECTURES, EXPERT, GGUFArchitecture, hf_tensor_name
from engine.model.quantized import KeepWeight, QuantizedWeight, Weight

_MISSING = object()
_Part = tuple[str, np.ndarray, tuple[int, ...]]  # HF name, the file's data, its [rows, ...] shape


def load_gguf(path: str, dtype: torch.dtype, keep: KeepWeight | None = None) -> tuple[
        ModelConfig, dict[str, torch.Tensor | QuantizedWeight], dict[str, str]]:
    """Config from the `{architecture}.*` / tokenizer.ggml.* metadata; every tensor under its HF name
    (each expert's under its own), as a QuantizedWeight for the block types gguf_blocks maps, else
    dequantized to `dtype` (with `keep`, the part of it `keep(config, name, tensor)` returns, taken
    before the next is read: None drops an expert another rank holds); and the tensors stored in
    other block types (HF name -> block type), which no kernel serves."""
    reader = gguf_reader(path)
    config = gguf_model_config(reader, path)
    permuted = ARCHITECTURES[str(reader.get("general.architecture"))].rope_permuted
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    dequantized: dict[str, str] = {}
    for tensor in reader.tensors:
        heads = _rope_heads(tensor.name, config) if permuted else None
        for name, data, shape in _parts(tensor, config, path):
            weight = _weight(data, tensor, shape, heads, dtype)
            if not isinstance(weight, QuantizedWeight) and tensor.tensor_type not in FLOAT_TYPES:
                dequantized[name] = tensor.tensor_type.name
            held = weight if keep is None else keep(config, name, weight)
            if held is not None:
                weights[name] = held
    return config, weights, dequantized


def _parts(tensor: GGUFTensor, config: ModelConfig, path: str) -> list[_Part]:
    """The HF-named weights one tensor holds: itself, or each expert's of a stack of experts."""
    # GGUF lists dimensions fastest-first; numpy (and torch) order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    name = hf_tensor_name(tensor.name)
    if EXPERT not in name:
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, *shape)  # llama.cpp reads Qwen2-MoE's one-row gate as a vector
        return [(name, tensor.data, shape)]
    experts = 0 if config.moe is None else config.moe.num_experts
    if len(shape) != 3 or shape[0] != experts:
        raise ValueError(f"{path}: {tensor.name} has shape {list(shape)}; expected {experts} experts "
                         "(the metadata's expert_count) of 2-D weights")
    # A stack's data is [experts, rows, row bytes or elements]: each expert's rows are one slice.
    return [(name.format(expert=expert), tensor.data[expert], shape[1:]) for expert in range(experts)]


def _weight(data: np.ndarray, tensor: GGUFTensor, shape: tuple[int, ...], heads: int | None,
            dtype: torch.dtype) -> Weight:
    """One weight from the file's data: integer groups where gguf_blocks maps the block type, else floats."""
    blocks = as_quantized(data, tensor.tensor_type, shape) if len(shape) == 2 else None  # type: ignore[arg-type]
    if blocks is not None:
        return blocks if heads is None else permute_rows(blocks, _rope_row_order(shape[0], heads))
    array = dequantize(data, tensor.tensor_type).reshape(shape)
    if heads is not None:
        array = array[_rope_row_order(shape[0], heads)]
    return _to_tensor(array, dtype)


def _rope_heads(gguf_name: str, config: ModelConfig) -> int | None:
    # llama.cpp's converter interleaves each head's rows for adjacent-pair RoPE; HF rotates halves.
    if gguf_name.endswith("attn_q.weight"):
        return config.num_heads
    if gguf_name.endswith("attn_k.weight"):
        return config.num_kv_heads
    return None


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
        self.path = path

    def get(self, key: str, default: object = _MISSING) -> object:
        entry = self._reader.get(key)
        if entry is not None:
            return entry
        if default is _MISSING:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key}")
        return default

    def as_int(self, key: str, default: object = _MISSING) -> int:
        return int(str(self.get(key, default)))

    def as_float(self, key: str, default: object = _MISSING) -> float:
        return float(str(self.get(key, default)))

    def optional_int(self, key: str) -> int | None:
        value = self.get(key, None)
        return None if value is None else int(str(value))


def gguf_model_config(reader: GGUFFile, path: str) -> ModelConfig:
    """The model's config from the `{architecture}.*` / tokenizer.ggml.* metadata (no tensor is read);
    ValueError naming what this engine cannot serve."""
    tied = "output.weight" not in {tensor.name for tensor in reader.tensors}
    meta = _Metadata(reader, path)
    name = str(meta.get("general.architecture"))
    if name not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}")
    architecture, arch = ARCHITECTURES[name], f"{name}."
    hidden_size = meta.as_int(f"{arch}embedding_length")
    num_heads = meta.as_int(f"{arch}attention.head_count")
    head_dim = meta.as_int(f"{arch}attention.key_length", hidden_size // num_heads)
    rotary_dim = meta.as_int(f"{arch}rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embedding ({rotary_dim} of {head_dim} dims) is unsupported")
    intermediate_size = meta.as_int(f"{arch}feed_forward_length")
    moe = _moe_config(meta, name, architecture, intermediate_size)
    hf_class = architecture.dense if moe is None else architecture.sparse
    if hf_class is None:
        raise ValueError(f"{path}: a {name!r} GGUF file {'without' if moe is None else 'with'} experts "
                         f"({arch}expert_count) is unsupported")
    eos_ids = (meta.optional_int("tokenizer.ggml.eos_token_id"), meta.optional_int("tokenizer.ggml.eot_token_id"))
    vocab_fallback = len(reader.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        vocab_size=meta.as_int(f"{arch}vocab_size", vocab_fallback),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=meta.as_int(f"{arch}block_count"),
        num_heads=num_heads,
        num_kv_heads=meta.as_int(f"{arch}attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta.as_float(f"{arch}attention.layer_norm_rms_epsilon"),
        rope_theta=meta.as_float(f"{arch}rope.freq_base", 10000.0),
        max_position_embeddings=meta.as_int(f"{arch}context_length"),
        tie_word_embeddings=tied,
        attention_bias=architecture.qkv_bias,
        rope_scaling=_rope_scaling(
            str(meta.get(f"{arch}rope.scaling.type", "none")), meta.as_float(f"{arch}rope.scaling.factor", 1.0), path
        ),
        bos_token_id=meta.optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        name=str(meta.get("general.name", os.path.splitext(os.path.basename(path))[0])),
        qk_norm=architecture.qk_norm,
        moe=moe,
        architecture=hf_class,
    )


def _moe_config(meta: _Metadata, name: str, architecture: GGUFArchitecture, dense_size: int) -> MoEConfig | None:
    """The mixture of experts the `{name}.expert_*` keys describe, None without experts; ValueError
    naming a variant llama.cpp's other MoE architectures write (sigmoid routing, scaled routing
    weights, dense leading layers), which this engine does not compute."""
    arch = f"{name}."
    experts = meta.as_int(f"{arch}expert_count", 0)
    if experts == 0:
        return None
    gating = meta.as_int(f"{arch}expert_gating_func", int(ExpertGatingFuncType.SOFTMAX))
    scale = meta.as_float(f"{arch}expert_weights_scale", 1.0)
    dense_layers = meta.as_int(f"{arch}leading_dense_block_count", 0)
    if gating != ExpertGatingFuncType.SOFTMAX or scale not in (0.0, 1.0) or dense_layers:  # 0.0: llama.cpp's unset
        raise ValueError(f"{meta.path}: unsupported mixture of experts ({arch}expert_gating_func={gating}, "
                         f"{arch}expert_weights_scale={scale}, {arch}leading_dense_block_count={dense_layers}); "
                         "only softmax routing, unscaled, in every layer")
    # Absent keys take llama.cpp's defaults: a Mixtral file's experts have the dense FFN's size.
    shared = meta.as_int(f"{arch}expert_shared_feed_forward_length", dense_size) if architecture.shared_expert else 0
    return MoEConfig(num_experts=experts, top_k=meta.as_int(f"{arch}expert_used_count"),
                     intermediate_size=meta.as_int(f"{arch}expert_feed_forward_length", dense_size),
                     normalize_top_k=bool(meta.get(f"{arch}expert_weights_norm", architecture.normalize_top_k)),
                     shared_intermediate_size=shared, shared_gate=shared > 0)


def _rope_scaling(kind: str, factor: float, path: str) -> RopeScaling | None:
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    raise ValueError(f"{path}: unsupported GGUF rope scaling {kind!r}")
