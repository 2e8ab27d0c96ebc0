"""GGUF files of transformers' mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) laid out as
llama.cpp's converter (convert_hf_to_gguf.py) lays them out, for the GGUF loader's tests and for
benchmarks that serve one random model with both Tandem and llama.cpp.

Each layer's experts are one 3-D tensor per projection (`blk.N.ffn_gate_exps`, ...), in `expert_type`
(quantized by gguf.quants); the routers, norms and Qwen2-MoE's shared-expert gate stay F32 as the
converter keeps them, every other matrix is in `dense_type`. Mixtral is llama.cpp's `llama`
architecture, its q/k rows interleaved per head for llama.cpp's adjacent-pair RoPE (the converter's
`permute`); the Qwen architectures keep HF's order. Nothing here calls the engine's loader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import PreTrainedModel


@dataclass(frozen=True)
class _Layout:
    architecture: str  # general.architecture
    permute_qk: bool
    normalize_top_k: bool  # what llama.cpp computes for the architecture, whatever the file says


_LAYOUTS = {
    "MixtralForCausalLM": _Layout("llama", permute_qk=True, normalize_top_k=True),
    "Qwen2MoeForCausalLM": _Layout("qwen2moe", permute_qk=False, normalize_top_k=False),
    "Qwen3MoeForCausalLM": _Layout("qwen3moe", permute_qk=False, normalize_top_k=True),
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {  # a layer's tensors (transformers 5 names, experts stacked) -> llama.cpp's
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{s}": f"attn_{p}.{s}" for p in "qkv" for s in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # kept F32 by the converter


def write_moe_gguf(model: PreTrainedModel, path: str | os.PathLike[str], expert_type: str = "F32",
                   dense_type: str = "F32") -> None:
    """Write `model` (a transformers MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM)
    to `path`, its experts in block type `expert_type` and its other matrices in `dense_type`
    (GGMLQuantizationType names: "F32", "F16", "Q8_0", "Q4_0", "Q4_K", ...; rows must fill whole
    blocks). ValueError for another class, or a Qwen model whose norm_topk_prob llama.cpp would ignore."""
    hf = model.config.to_dict()
    layout = _LAYOUTS.get(type(model).__name__)
    if layout is None:
        raise ValueError(f"{type(model).__name__}: not one of {', '.join(_LAYOUTS)}")
    if hf.get("norm_topk_prob", layout.normalize_top_k) != layout.normalize_top_k:
        raise ValueError(f"norm_topk_prob={hf['norm_topk_prob']}: llama.cpp's {layout.architecture} computes "
                         f"{layout.normalize_top_k} whatever the file says")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r}: only the default RoPE is written")
    writer = GGUFWriter(str(path), layout.architecture)
    _write_metadata(writer, hf, float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))))
    _write_tokenizer(writer, hf)
    types = {"expert": GGMLQuantizationType[expert_type], "dense": GGMLQuantizationType[dense_type]}
    for name, array in _tensors(model, layout):
        qtype = (GGMLQuantizationType.F32 if array.ndim == 1 or name.endswith(_F32)
                 else types["expert" if array.ndim == 3 else "dense"])
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer: GGUFWriter, hf: dict[str, Any], rope_theta: float) -> None:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_expert_count(hf.get("num_local_experts") or hf["num_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    # Mixtral's experts have the dense FFN's size, which llama.cpp's `llama` reads them at.
    writer.add_expert_feed_forward_length(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    if hf.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])


def _write_tokenizer(writer: GGUFWriter, hf: dict[str, Any]) -> None:
    """A byte-level BPE vocabulary both llama.cpp and Tandem load (a random model has no text worth
    tokenizing): GPT-2's byte alphabet in byte order as far as it fits, fillers, and last the one
    merge llama.cpp requires, of two spaces."""
    size = int(hf["vocab_size"])
    alphabet = _byte_alphabet()
    if size <= alphabet.index("Ġ") + 1:
        raise ValueError(f"vocab_size {size}: too small for the byte-level vocabulary written (at least 34)")
    tokens = [*alphabet[: size - 1], *(f"<t{i}>" for i in range(len(alphabet), size - 1)), "ĠĠ"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ Ġ"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        token_id = hf.get(key)
        if isinstance(token_id, int) and 0 <= token_id < size:
            add(token_id)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level characters in byte order: printable bytes stand for themselves, the others
    take code points from 256 up (every character of a byte-level token must be one of these)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]


def _tensors(model: PreTrainedModel, layout: _Layout) -> list[tuple[str, np.ndarray]]:
    """Every tensor under llama.cpp's name, as float32 arrays in numpy (HF) dimension order."""
    config = model.config
    tensors: list[tuple[str, np.ndarray]] = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if hf_name in _GLOBAL:
            tensors.append((_GLOBAL[hf_name], array))
            continue
        _, _, layer, within = hf_name.split(".", 3)  # model.layers.N.<within>
        block = f"blk.{layer}."
        if within == "mlp.experts.gate_up_proj":  # [experts, gate rows then up rows, hidden]
            gate, up = np.split(array, 2, axis=1)
            tensors += [(f"{block}ffn_gate_exps.weight", gate), (f"{block}ffn_up_exps.weight", up)]
            continue
        if within not in _LAYER:
            raise ValueError(f"{hf_name}: no llama.cpp name for it here")
        name = _LAYER[within]
        if layout.permute_qk and name in ("attn_q.weight", "attn_k.weight"):
            heads = config.num_attention_heads if name == "attn_q.weight" else config.num_key_value_heads
            array = _interleave_heads(array, heads)
        # llama.cpp's converter squeezes Qwen2-MoE's one-row shared-expert gate to a vector.
        tensors.append((block + name, array.reshape(-1) if name == "ffn_gate_inp_shexp.weight" else array))
    return tensors


def _interleave_heads(weight: np.ndarray, heads: int) -> np.ndarray:
    """The converter's `permute`: within each head, HF's rotate-half pairs (i, i + d/2) made adjacent rows."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
