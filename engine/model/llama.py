"""Llama-family decoder over a paged KV cache: fused QKV and gate/up matmuls, HF weight names at the boundary."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import QuantizedLinear
from engine.model.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from engine.model.weight_formats import WeightFormat

Weight = torch.Tensor | QuantizedWeight
Product = Callable[[torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> RMSNorm(x)
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, cos, sin) -> rotated x
Gate = Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2I] -> silu(gate) * up [T, I]
# (hidden, cos, sin, kv_caches, meta) -> every layer's output for a step it serves, else None
Stacked = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[tuple[torch.Tensor, torch.Tensor]],
                    AttentionMetadata], torch.Tensor | None]


def _empty_parameter(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalise in float32, scale by the weight in the model dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up over the fused gate/up product's output."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


class LlamaDecoderLayer(torch.nn.Module):
    """One pre-norm block; q/k/v and gate/up are fused so each is a single product.

    The products (`linears`) are built by `LlamaForCausalLM.load_weights` in the weight format
    chosen at load; the norms' weights (and Qwen2's QKV bias) are parameters; `norm`, `rotate`
    and `gate` compute RMSNorm, the rotary embedding and SwiGLU's gating (`LlamaForCausalLM.use_kernels`).
    """

    def __init__(self, config: ModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.attention = attention
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_bias = _empty_parameter(qkv_rows) if config.attention_bias else None
        self.input_layernorm = _empty_parameter(config.hidden_size)
        self.post_attention_layernorm = _empty_parameter(config.hidden_size)
        self.linears: dict[str, Product] = {}
        self.norm: Norm = rms_norm
        self.rotate: Rotate = apply_rotary
        self.gate: Gate = silu_mul

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
        qkv = self.linears["qkv"](self.norm(hidden, self.input_layernorm, self.eps))
        qk_heads = self.num_heads + self.num_kv_heads
        # Q and K rotate by the same angles, so they are rotated together in one pass.
        qk = self.rotate(qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return hidden + self.linears["o"](out.reshape(num_tokens, -1))

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + SwiGLU(norm(hidden))."""
        gate_up = self.linears["gate_up"](self.norm(hidden, self.post_attention_layernorm, self.eps))
        return hidden + self.linears["down"](self.gate(gate_up))


class LlamaForCausalLM(torch.nn.Module):
    """The decoder stack plus LM head; attention goes through the given paged-attention backend.

    Parameters are allocated uninitialised (in the default dtype, on the current default device);
    `load_weights` fills them from HF-named tensors and builds the embedding and the products.
    """

    def __init__(self, config: ModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, attention) for _ in range(config.num_layers))
        self.norm = _empty_parameter(config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.embed: Product = _not_loaded
        self.head: Product = _not_loaded
        self.final_norm: Norm = rms_norm
        self.stacked: Stacked | None = None  # all the layers in one call, where set (use_stacked)
        self.gather_logits: Product | None = None  # a tensor-parallel rank's join of the vocabulary's parts

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
        hidden = self.embed(input_ids)
        cos, sin = self.rotary.forward(positions)
        if self.stacked is not None and on_layer_done is None:
            stacked = self.stacked(hidden, cos, sin, kv_caches, meta)
            if stacked is not None:
                return self.final_norm(stacked, self.norm, self.config.rms_norm_eps)
        for index, layer in enumerate(self.layers):
            hidden = layer.attention_block(hidden, cos, sin, kv_caches[index], meta)
            if on_layer_done is not None:
                on_layer_done(index)
            hidden = layer.mlp_block(hidden)
        return self.final_norm(hidden, self.norm, self.config.rms_norm_eps)

    def use_kernels(self, norm: Norm, rotate: Rotate, gate: Gate) -> None:
        """Compute every RMSNorm with `norm`, rotary embedding with `rotate` and SwiGLU gating with
        `gate` (the arithmetic of `rms_norm`, `apply_rotary` and `silu_mul`, as one op each: the CPU
        kernels'; `rotate` may work in place)."""
        self.final_norm = norm
        for layer in self.layers:
            layer.norm, layer.rotate, layer.gate = norm, rotate, gate

    def use_stacked(self, stacked: Stacked | None) -> None:
        """Run the layers of the steps `stacked` serves as that one call (engine.model.decode_stack:
        the same arithmetic as the layers with the CPU kernels, without a torch call per op)."""
        self.stacked = stacked

    def use_logits_gather(self, gather: Product) -> None:
        """Join the logits of this rank's part of the vocabulary with the other ranks' (tensor
        parallelism: engine.parallel.collectives)."""
        self.gather_logits = gather

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the given final hidden states (a quantized head's kernel
        output as it computes it, in fp32, whatever the model's dtype)."""
        logits = self.head.fp32(hidden) if isinstance(self.head, QuantizedLinear) else self.head(hidden).float()
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def load_weights(self, weights: Mapping[str, Weight], formats: WeightFormat) -> None:
        """Fill the parameters from HF-named tensors and build the embedding and products in `formats`.

        Raises ValueError naming every missing, unexpected or mis-shaped tensor; nothing is loaded then.
        """
        expected = self._weight_shapes()
        missing = sorted(expected.keys() - weights.keys())
        unexpected = sorted(weights.keys() - expected.keys())
        misshaped = sorted(
            f"{name} (expected {expected[name]}, got {tuple(weights[name].shape)})"
            for name in expected.keys() & weights.keys()
            if tuple(weights[name].shape) != expected[name]
        )
        problems = [
            f"{label}: {_summarise(names)}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
            if names
        ]
        if problems:
            raise ValueError("weights do not fit the model: " + "; ".join(problems))
        with torch.no_grad():
            self._load(weights, formats)

    def _load(self, weights: Mapping[str, Weight], formats: WeightFormat) -> None:
        def parts(*names: str) -> list[tuple[str, Weight]]:
            return [(name, weights[name]) for name in names]

        def parameter(target: torch.Tensor, name: str) -> None:
            source = weights[name]
            target.copy_(source.dequantize() if isinstance(source, QuantizedWeight) else source)

        parameter(self.norm, "model.norm.weight")
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
            parameter(layer.input_layernorm, f"{prefix}input_layernorm.weight")
            parameter(layer.post_attention_layernorm, f"{prefix}post_attention_layernorm.weight")
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([weights[f"{attn}{p}_proj.bias"] for p in "qkv"]))  # type: ignore[misc]
            layer.linears = {
                "qkv": formats.product(parts(*(f"{attn}{p}_proj.weight" for p in "qkv")), layer.qkv_bias),
                "o": formats.product(parts(f"{attn}o_proj.weight")),
                "gate_up": formats.product(parts(f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")),
                "down": formats.product(parts(f"{mlp}down_proj.weight")),
            }
        embedding = weights["model.embed_tokens.weight"]
        if self.config.tie_word_embeddings:
            self.embed, self.head = formats.tied("model.embed_tokens.weight", embedding)
        else:
            self.embed = formats.embedding(embedding)
            self.head = formats.product(parts("lm_head.weight"))

    def _weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> the shape the model expects."""
        config = self.config
        hidden, inter = config.hidden_size, config.intermediate_size
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config.vocab_size, hidden),
            "model.norm.weight": (hidden,),
        }
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, hidden)
        for index in range(config.num_layers):
            prefix = f"model.layers.{index}."
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                shapes[f"{prefix}self_attn.{proj}_proj.weight"] = (rows, hidden)
                if config.attention_bias:
                    shapes[f"{prefix}self_attn.{proj}_proj.bias"] = (rows,)
            shapes[f"{prefix}self_attn.o_proj.weight"] = (hidden, q_rows)
            shapes[f"{prefix}mlp.gate_proj.weight"] = (inter, hidden)
            shapes[f"{prefix}mlp.up_proj.weight"] = (inter, hidden)
            shapes[f"{prefix}mlp.down_proj.weight"] = (hidden, inter)
            shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
            shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
        return shapes


def _not_loaded(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the model's weights are not loaded (LlamaForCausalLM.load_weights)")


def _summarise(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit} more)"
