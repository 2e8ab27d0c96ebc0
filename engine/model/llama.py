"""Llama-family decoder over a paged KV cache: fused QKV and gate/up matmuls, HF weight names at the boundary."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.lora.product import LoraAdd, LoraStep
from engine.model.moe_weights import build_moe
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import QuantizedLinear
from engine.model.rope import RotaryEmbedding, apply_rotary
from engine.model.weight_shapes import weight_shapes

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


class Sharding(Protocol):
    """How a tensor-parallel rank's model, built from its shard, computes what the whole model computes
    together with the other ranks (engine.parallel.collectives)."""

    def row_parallel(self, product: Product) -> Product:
        """A row-parallel product (o, down): this rank's partial sum made the sum over the ranks."""
        ...

    def wrap_partial(self, product: Product, wrap: Callable[[Product], Product]) -> Product:
        """`product` with `wrap` around its partial sum (before the all-reduce) if it is row-parallel,
        else around it whole: so a term a rank adds over its own input features (a LoRA adapter's,
        engine.lora.serving) joins the one all-reduce."""
        ...

    def embedding(self, embed: Product) -> Product:
        """The lookup of every token id, of which this rank holds a part of the vocabulary's rows."""
        ...

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's part of the vocabulary's logits joined with the other ranks'."""
        ...


def _empty_parameter(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalise in float32, scale by the weight in the model dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up over the fused gate/up product's output."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ModelPlan:
    """The model's choices, made before it is built (engine.model.loader.build_model): the ops that
    compute RMSNorm, the rotary embedding and SwiGLU's gating (the arithmetic of `rms_norm`,
    `apply_rotary` and `silu_mul`, as one op each where the CPU kernels build; `rotate` may work in
    place), the builder of the layers as one call for the decode steps it serves over the loaded model
    (engine.model.decode_stack; None: the layers always run one by one), and a tensor-parallel rank's
    sharding. Each product's own plan is its weight format's (engine.model.product_plan)."""

    norm: Norm = rms_norm
    rotate: Rotate = apply_rotary
    gate: Gate = silu_mul
    decode_stack: Callable[[LlamaForCausalLM], Stacked | None] | None = None
    sharding: Sharding | None = None
    # StreamingLLM (engine.attention.streaming): the layers hand q and k to the attention backend
    # unrotated, and it rotates them at their positions within the cache, which text positions outgrow.
    rotary_in_attention: bool = False
    # The op adding a small step's LoRA terms by adapter slot (engine.lora.product), where the CPU
    # kernels build; None: torch's products.
    lora_add: LoraAdd | None = None

    def __post_init__(self) -> None:
        if self.decode_stack is not None and self.sharding is not None:
            raise ValueError("a tensor-parallel model has no decode stack: it runs a step without the collectives")


class LlamaDecoderLayer(torch.nn.Module):
    """One pre-norm block; q/k/v and gate/up are fused so each is a single product.

    The products (`linears`) are built by `LlamaForCausalLM.load_weights` in the weight format
    chosen at load, and so is the mixture of experts (`moe`) that replaces the dense MLP where the
    model has one; the norms' weights (Qwen3's per-head q/k norms too, and Qwen2's QKV bias) are
    parameters; `norm`, `rotate` and `gate` compute RMSNorm, the rotary embedding and SwiGLU's
    gating (`ModelPlan`).
    """

    def __init__(self, config: ModelConfig, attention: AttentionBackend, plan: ModelPlan) -> None:
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
        self.q_norm = _empty_parameter(config.head_dim) if config.qk_norm else None
        self.k_norm = _empty_parameter(config.head_dim) if config.qk_norm else None
        self.linears: dict[str, Product] = {}
        self.moe: Product | None = None  # the MoE MLP (made whole across ranks), where the model has one
        self.norm = plan.norm
        self.rotate = plan.rotate
        self.gate = plan.gate

    def attention_block(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden + self-attention(norm(hidden)); writes this step's K/V into the layer's cache.
        Without `cos` and `sin`, q and k go to the attention backend unrotated (rotary_in_attention)."""
        num_tokens = hidden.shape[0]
        qkv = self.linears["qkv"](self.norm(hidden, self.input_layernorm, self.eps))
        qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.norm(q, self.q_norm, self.eps), self.norm(k, self.k_norm, self.eps)), dim=1)
        # Q and K rotate by the same angles, so they are rotated together in one pass.
        if cos is not None and sin is not None:
            qk = self.rotate(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return hidden + self.linears["o"](out.reshape(num_tokens, -1))

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + SwiGLU(norm(hidden)), or + the mixture of experts over norm(hidden)."""
        normed = self.norm(hidden, self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            return hidden + self.moe(normed)
        return hidden + self.linears["down"](self.gate(self.linears["gate_up"](normed)))


class LlamaForCausalLM(torch.nn.Module):
    """The decoder stack plus LM head; attention goes through the given paged-attention backend.

    Parameters are allocated uninitialised (in the default dtype, on the current default device);
    `load_weights` fills them from HF-named tensors and builds the embedding and the products, and the
    decode stack where `plan` has one.
    """

    def __init__(self, config: ModelConfig, attention: AttentionBackend, plan: ModelPlan | None = None) -> None:
        super().__init__()
        self.config = config
        self.plan = ModelPlan() if plan is None else plan
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, attention, self.plan)
                                          for _ in range(config.num_layers))
        self.norm = _empty_parameter(config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.embed: Product = _not_loaded
        self.head: Product = _not_loaded
        self.final_norm = self.plan.norm
        self.stacked: Stacked | None = None  # all the layers in one call, built at load where the plan has it
        self.lora_step = LoraStep()  # the step's rows by LoRA slot (engine.lora.product; none without adapters)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] for the packed new tokens of all sequences.

        `on_layer_done(i)` runs as soon as layer i (the model's index) has written its K/V (before its
        MLP), so a layer-by-layer KV transfer can start while the rest of the stack computes;
        `before_layer(i)` runs before layer i's attention reads the cache, so pages loading into it
        layer by layer (a lower KV tier's) need only have reached that layer. A
        pipeline stage's model (config.stage) takes the previous stage's hidden states in place of
        `input_ids` unless it is the first, and returns its last layer's output unless it is the last.
        """
        config = self.config
        hidden = self.embed(input_ids) if config.first_stage else input_ids
        # Positions in the text may pass the model's table where the attention rotates (ModelPlan).
        cos, sin = (None, None) if self.plan.rotary_in_attention else self.rotary.forward(positions)
        # The decode stack runs the base's products only: a step with LoRA rows runs layer by layer.
        if (self.stacked is not None and not self.lora_step.batch and on_layer_done is None and before_layer is None
                and cos is not None
                and sin is not None):
            stacked = self.stacked(hidden, cos, sin, kv_caches, meta)
            if stacked is not None:
                return self.final_norm(stacked, self.norm, self.config.rms_norm_eps)
        for index, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(config.first_layer + index)
            hidden = layer.attention_block(hidden, cos, sin, kv_caches[index], meta)
            if on_layer_done is not None:
                on_layer_done(config.first_layer + index)
            hidden = layer.mlp_block(hidden)
        return self.final_norm(hidden, self.norm, config.rms_norm_eps) if config.last_stage else hidden

    def keep_first_layers(self, num_layers: int) -> None:
        """Keep only the first `num_layers` layers (an early-exit draft), the decode stack built over them."""
        self.layers = self.layers[:num_layers]
        self.stacked = None if self.plan.decode_stack is None else self.plan.decode_stack(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the given final hidden states (a quantized head's kernel
        output as it computes it, in fp32, whatever the model's dtype)."""
        logits = self.head.fp32(hidden) if isinstance(self.head, QuantizedLinear) else self.head(hidden).float()
        sharding = self.plan.sharding
        return logits if sharding is None else sharding.gather_logits(logits)

    def load_weights(self, weights: Mapping[str, Weight], formats: WeightFormat) -> None:
        """Fill the parameters from HF-named tensors, build the embedding and products in `formats`, and
        the decode stack where the plan has one.

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
        self.stacked = None if self.plan.decode_stack is None else self.plan.decode_stack(self)

    def _load(self, weights: Mapping[str, Weight], formats: WeightFormat) -> None:
        def parts(*names: str) -> list[tuple[str, Weight]]:
            return [(name, weights[name]) for name in names]

        def parameter(target: torch.Tensor, name: str) -> None:
            source = weights[name]
            target.copy_(source.dequantize() if isinstance(source, QuantizedWeight) else source)

        sharded = self.plan.sharding
        row_parallel = (lambda product: product) if sharded is None else sharded.row_parallel
        config = self.config
        if config.last_stage:
            parameter(self.norm, "model.norm.weight")
        for index, layer in enumerate(self.layers, start=config.first_layer):
            prefix = f"model.layers.{index}."
            attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
            parameter(layer.input_layernorm, f"{prefix}input_layernorm.weight")
            parameter(layer.post_attention_layernorm, f"{prefix}post_attention_layernorm.weight")
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([weights[f"{attn}{p}_proj.bias"] for p in "qkv"]))  # type: ignore[misc]
            if layer.q_norm is not None and layer.k_norm is not None:
                parameter(layer.q_norm, f"{attn}q_norm.weight")
                parameter(layer.k_norm, f"{attn}k_norm.weight")
            layer.linears = {
                "qkv": formats.product("qkv", parts(*(f"{attn}{p}_proj.weight" for p in "qkv")), layer.qkv_bias),
                "o": row_parallel(formats.product("o", parts(f"{attn}o_proj.weight"))),
            }
            if self.config.moe is None:
                layer.linears["gate_up"] = formats.product("gate_up", parts(f"{mlp}gate_proj.weight",
                                                                            f"{mlp}up_proj.weight"))
                layer.linears["down"] = row_parallel(formats.product("down", parts(f"{mlp}down_proj.weight")))
            else:
                layer.moe = row_parallel(build_moe(self.config.moe, mlp, weights, formats, layer.gate))
        # A pipeline stage holds the embedding if it is the first (and, tied, the last: as the head).
        if config.tie_word_embeddings and (config.first_stage or config.last_stage):
            self.embed, self.head = formats.tied("model.embed_tokens.weight", weights["model.embed_tokens.weight"])
        else:
            if config.first_stage:
                self.embed = formats.embedding(weights["model.embed_tokens.weight"])
            if config.last_stage:
                self.head = formats.product("lm_head", parts("lm_head.weight"))
        if sharded is not None and config.first_stage:
            self.embed = sharded.embedding(self.embed)

    def _weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> the shape the model expects."""
        return weight_shapes(self.config)


def _not_loaded(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the model's weights are not loaded (LlamaForCausalLM.load_weights)")


def _summarise(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit} more)"
