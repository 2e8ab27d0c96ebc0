"""The tensors a model of a given shape reads, by HF name, and each one's shape: what
LlamaForCausalLM.load_weights checks a checkpoint (or a rank's shard of it) against."""

from __future__ import annotations

from engine.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


def weight_shapes(config: ModelConfig) -> Shapes:
    """HF tensor name -> the shape the model `config` describes expects (a shard's or a pipeline
    stage's config: its part)."""
    hidden = config.hidden_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: Shapes = {}
    # A pipeline stage's: the embedding on the first (a tied one on the last too), the head on the last.
    if config.first_stage or (config.last_stage and config.tie_word_embeddings):
        shapes["model.embed_tokens.weight"] = (config.vocab_size, hidden)
    if config.last_stage:
        shapes["model.norm.weight"] = (hidden,)
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for index in range(config.first_layer, config.first_layer + config.num_layers):
        prefix = f"model.layers.{index}."
        for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            shapes[f"{prefix}self_attn.{proj}_proj.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{prefix}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[f"{prefix}self_attn.o_proj.weight"] = (hidden, q_rows)
        if config.qk_norm:
            shapes[f"{prefix}self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"{prefix}self_attn.k_norm.weight"] = (config.head_dim,)
        shapes.update(_mlp_shapes(config, f"{prefix}mlp."))
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    return shapes


def _mlp_shapes(config: ModelConfig, mlp: str) -> Shapes:
    """The MLP's tensors under `mlp`: dense SwiGLU, or the router, the experts held and the shared expert."""
    hidden, moe = config.hidden_size, config.moe

    def swiglu(prefix: str, inter: int) -> Shapes:
        return {f"{prefix}gate_proj.weight": (inter, hidden), f"{prefix}up_proj.weight": (inter, hidden),
                f"{prefix}down_proj.weight": (hidden, inter)}

    if moe is None:
        return swiglu(mlp, config.intermediate_size)
    shapes: Shapes = {f"{mlp}gate.weight": (moe.num_experts, hidden)}
    for expert in moe.held:
        shapes.update(swiglu(f"{mlp}experts.{expert}.", moe.intermediate_size))
    if moe.shared_intermediate_size:
        shapes.update(swiglu(f"{mlp}shared_expert.", moe.shared_intermediate_size))
    if moe.shared_gate:
        shapes[f"{mlp}shared_expert_gate.weight"] = (1, hidden)
    return shapes
