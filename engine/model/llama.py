"""Llama-family decoder over a paged KV cache: fused QKV and gate/up matmuls, HF weight names at the boundary."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionBackend, AttentionMetadata
from engine.config import CpuWeights, ModelConfig
from engine.model.linear import Linear
from engine.model.rope import RotaryEmbedding, apply_rotary


def _empty_parameter(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalise in float32, scale by the weight in the model dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


class LlamaDecoderLayer(torch.nn.Module):
    """One pre-norm block; q/k/v and gate/up are stored fused so each is a single matmul."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.attention = attention
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = _empty_parameter(qkv_rows, config.hidden_size)
        self.qkv_bias = _empty_parameter(qkv_rows) if config.attention_bias else None
        self.o_proj = _empty_parameter(config.hidden_size, config.num_heads * config.head_dim)
        self.gate_up_proj = _empty_parameter(2 * config.intermediate_size, config.hidden_size)
        self.down_proj = _empty_parameter(config.hidden_size, config.intermediate_size)
        self.input_layernorm = _empty_parameter(config.hidden_size)
        self.post_attention_layernorm = _empty_parameter(config.hidden_size)
        self.linears = {
            "qkv": Linear(self.qkv_proj, self.qkv_bias),
            "o": Linear(self.o_proj),
            "gate_up": Linear(self.gate_up_proj),
            "down": Linear(self.down_proj),
        }

    def attention_block(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden + self-attention(norm(hidden)); writes this step's K/V into the layer's cache."""
        num_tokens = hidden.shape[0]
        qkv = self.linears["qkv"](rms_norm(hidden, self.input_layernorm, self.eps))
        qk_heads = self.num_heads + self.num_kv_heads
        # Q and K rotate by the same angles, so they are rotated together in one pass.
        qk = apply_rotary(qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return hidden + self.linears["o"](out.reshape(num_tokens, -1))

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + SwiGLU(norm(hidden))."""
        gate, up = self.linears["gate_up"](rms_norm(hidden, self.post_attention_layernorm, self.eps)).chunk(2, -1)
        return hidden + self.linears["down"](F.silu(gate) * up)


class LlamaForCausalLM(torch.nn.Module):
    """The decoder stack plus LM head; attention goes through the given paged-attention backend.

    Parameters are allocated uninitialised (in the default dtype, on the current default device);
    `load_weights` fills them from HF-named tensors.
    """

    def __init__(self, config: ModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _empty_parameter(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, attention) for _ in range(config.num_layers))
        self.norm = _empty_parameter(config.hidden_size)
        self.lm_head = None if config.tie_word_embeddings else _empty_parameter(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.head = Linear(self.embed_tokens if self.lm_head is None else self.lm_head)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] for the packed new tokens of all sequences.

        `on_layer_done(i)` runs as soon as layer i has written its K/V (before its MLP), so a
        layer-by-layer KV transfer can start while the rest of the stack computes.
        """
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.forward(positions)
        for index, layer in enumerate(self.layers):
            hidden = layer.attention_block(hidden, cos, sin, kv_caches[index], meta)
            if on_layer_done is not None:
                on_layer_done(index)
            hidden = layer.mlp_block(hidden)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the given final hidden states."""
        return self.head(hidden).float()

    def prepare_weights(self, weights: CpuWeights) -> None:
        """Prepare every matrix product's weight in the given CPU format (engine.model.linear), once
        loaded; products where it does not apply (not fp32 on CPU) keep the plain one."""
        for linear in [self.head, *(linear for layer in self.layers for linear in layer.linears.values())]:
            linear.prepare(weights)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the (fused) parameters, converting dtype and device.

        Raises ValueError naming every missing, unexpected or mis-shaped tensor; nothing is copied then.
        """
        targets = self._weight_targets()
        missing = sorted(targets.keys() - weights.keys())
        unexpected = sorted(weights.keys() - targets.keys())
        misshaped = sorted(
            f"{name} (expected {tuple(targets[name].shape)}, got {tuple(weights[name].shape)})"
            for name in targets.keys() & weights.keys()
            if tuple(weights[name].shape) != tuple(targets[name].shape)
        )
        problems = [
            f"{label}: {_summarise(names)}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
            if names
        ]
        if problems:
            raise ValueError("weights do not fit the model: " + "; ".join(problems))
        with torch.no_grad():
            for name, target in targets.items():
                target.copy_(weights[name])

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the parameter (or row slice of a fused parameter) it fills."""
        config = self.config
        q_rows = config.num_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        qkv_slices = {"q": slice(0, q_rows), "k": slice(q_rows, q_rows + kv_rows), "v": slice(q_rows + kv_rows, None)}
        targets: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens,
            "model.norm.weight": self.norm,
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            for proj, rows in qkv_slices.items():
                targets[f"{prefix}self_attn.{proj}_proj.weight"] = layer.qkv_proj[rows]
                if layer.qkv_bias is not None:
                    targets[f"{prefix}self_attn.{proj}_proj.bias"] = layer.qkv_bias[rows]
            targets[f"{prefix}self_attn.o_proj.weight"] = layer.o_proj
            targets[f"{prefix}mlp.gate_proj.weight"] = layer.gate_up_proj[: config.intermediate_size]
            targets[f"{prefix}mlp.up_proj.weight"] = layer.gate_up_proj[config.intermediate_size :]
            targets[f"{prefix}mlp.down_proj.weight"] = layer.down_proj
            targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm
            targets[f"{prefix}post_attention_layernorm.weight"] = layer.post_attention_layernorm
        return targets


def _summarise(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit} more)"
