"""The GGUF architectures this engine reads, as llama.cpp names and converts them: what each one's
file holds beyond a Llama's, and the HF name the model reads each of its tensors under."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFArchitecture:
    """One `general.architecture`: the HF class its files are read as, with experts (`{arch}.expert_count`
    > 0) and without (None where llama.cpp refuses that form), and how llama.cpp's converter wrote it."""

    dense: str | None
    sparse: str | None
    # The converter interleaves each q/k head's rows for llama.cpp's adjacent-pair RoPE; the NEOX-RoPE
    # architectures keep HF's rotate-half order.
    rope_permuted: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    shared_expert: bool = False  # Qwen2-MoE's, scaled by sigmoid(its gate)
    # Whether llama.cpp renormalises the top-k routing weights, absent an `{arch}.expert_weights_norm` key.
    normalize_top_k: bool = False


ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "MixtralForCausalLM", rope_permuted=True, normalize_top_k=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", None, qkv_bias=True),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", None, qk_norm=True),
    "qwen2moe": GGUFArchitecture(None, "Qwen2MoeForCausalLM", qkv_bias=True, shared_expert=True),
    "qwen3moe": GGUFArchitecture(None, "Qwen3MoeForCausalLM", qk_norm=True, normalize_top_k=True),
}
# In a name from hf_tensor_name, where each expert's id goes: llama.cpp stacks every expert's weight
# in one 3-D tensor, the model reads one 2-D weight per expert.
EXPERT = "{expert}"

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """The HF parameter name of a GGUF tensor (with EXPERT for a stack of experts); ValueError for
    tensors this model does not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
