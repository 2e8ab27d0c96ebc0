"""A small decode batch's decoder layers as one call into the CPU kernels (decode_stack.cpp).

From Python a batch-1 step spends a large part of its time in dispatch and the Python between its
torch calls, some 40 a layer (`python -m bench decode_overhead`). The kernels' DecodeStack holds
every layer's packed weights and runs the same kernels in the same order from C++, so the step
computes the same bits (tests/unit/test_decode_stack.py) and pays one call for all the layers.
A mixture-of-experts layer (no shared expert, every expert held) runs in it too, for one-row
steps: the router, its top k and the chosen experts' products as SparseMoE's batch-1 path has them.

It serves a step only where every product's plan would have taken those kernels: a step of short
queries (decode rows, and speculative verifications: engine.attention.reference.SHORT_QUERY) whose
rows all fit every product's first band, the packed-group kernel's (engine.model.product_plan),
with dense pages and no per-layer callback. A verification's rows attend as the layers' attention
has them attend, each as a decode row over its own prefix (AttentionMetadata.per_query_row), so the
bits are the same; served by the layers, a verification paid the Python between their ops, which
made a step of two rows cost 1.9 of one row's instead of the stack's 1.6 (AMD EPYC, AVX2). Anything
else goes through the layers one op at a time. The model builds it at load where its plan says so (engine.model.llama.
ModelPlan), so a tensor-parallel rank, whose products join the other ranks', has none.

In fp32 every op is the layers' own kernel, so the bits are the same. A bf16 model (`--dtype auto`
on a CPU with native bf16) runs the stack too, in fp32 inside: the products' kernels compute in
fp32 either way, so only the roundings to bf16 between ops differ, and the stack drops them (its
hidden states are closer to fp32's than the layers' are). Its pages are bf16, widened as they are
read and rounded as they are written as the layers round them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import SHORT_QUERY, TorchPagedAttention
from engine.model.kernels import KERNEL_DTYPES, Kernels
from engine.model.linear import Linear
from engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.model.moe import ExpertLoop, SparseMoE
from engine.model.quantized_linear import QuantizedLinear

PRODUCTS = ("qkv", "o", "gate_up", "down")  # the order DecodeStack takes a layer's products in
Caches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class DecodeStack:
    """The layers of `model` as one kernel call, for the decode steps it serves (see the module)."""

    def __init__(self, model: LlamaForCausalLM, ops: Kernels) -> None:
        config = model.config
        first = model.layers[0]
        self._ops = ops
        self._dtype = model.norm.dtype
        self._stack = ops.decode_stack(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                       first.scale)
        limits = []
        for layer in model.layers:
            self._stack.add_layer(layer.input_layernorm.detach().float(),
                                  layer.post_attention_layernorm.detach().float())
            products = [layer.linears[name] for name in PRODUCTS if name in layer.linears]
            if isinstance(layer.moe, SparseMoE):  # build() checked the router and the experts
                moe, loop = layer.moe, layer.moe.experts
                assert isinstance(moe.router, Linear) and isinstance(loop, ExpertLoop)
                self._stack.add_router(moe.router.weight.detach().float(), moe.config.top_k, moe.config.normalize_top_k)
                experts = [loop.experts[e] for e in sorted(loop.experts)]
                products += [part for expert in experts for part in (expert.gate_up, expert.down)]
                limits.append(2)  # one row: the layers' own batch-1 path (SparseMoE._one_row)
            for product in products:
                assert isinstance(product, QuantizedLinear)  # build() checked
                w = product.weight
                self._stack.add_product(w.packed, w.scale, w.offset, product.bias32, w.bits, w.group_size, w.rows)
                limits.append(product.plan.ends[0])
        self.max_rows = min(limits) - 1

    @classmethod
    def build(cls, model: LlamaForCausalLM, ops: Kernels) -> DecodeStack | None:
        """The stack for an fp32 or bf16 model whose every product is a quantized weight in input
        order on these kernels (another build rounds differently), with the kernels' decode
        attention; None otherwise (the layers then run one by one)."""
        layers = model.layers
        attention = layers[0].attention
        served = (
            model.norm.dtype in KERNEL_DTYPES
            and isinstance(attention, TorchPagedAttention) and attention.dense_decode is not None
            and model.config.head_dim % 8 == 0
            and all(_kernel_products(layer, ops) for layer in layers)
        )
        return cls(model, ops) if served else None

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Caches,
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """The last layer's output for this step, its K/V written; None where the stack does not
        serve the step (the caller runs the layers)."""
        if meta.max_query_len > SHORT_QUERY or hidden.shape[0] > self.max_rows or kv_caches[0][0].dtype != self._dtype:
            return None
        block_tables, seq_lens = meta.per_query_row
        out = self._ops.run_decode_stack(self._stack, hidden.float(), cos.float(), sin.float(),
                                         [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
                                         block_tables, seq_lens)
        return out.to(self._dtype)


def _kernel_products(layer: LlamaDecoderLayer, ops: Kernels) -> bool:
    """Whether every product of the layer runs on these kernels: its four, or with a mixture of
    experts (no shared expert, every expert held) its attention's two and every expert's."""
    linears, moe = layer.linears, layer.moe
    if moe is None:
        return all(_kernel_product(linears.get(name), ops) for name in PRODUCTS)
    if not (isinstance(moe, SparseMoE) and isinstance(moe.experts, ExpertLoop) and moe.shared is None
            and isinstance(moe.router, Linear) and moe.router.plan.bands[0].kernel == "linear"
            and len(moe.experts.experts) == moe.config.num_experts):
        return False
    experts = [part for expert in moe.experts.experts.values() for part in (expert.gate_up, expert.down)]
    return all(_kernel_product(product, ops) for product in (linears.get("qkv"), linears.get("o"), *experts))


def _kernel_product(product: object, ops: Kernels) -> bool:
    return (isinstance(product, QuantizedLinear) and product.weight.perm is None and product.ops is ops
            and product.plan.bands[0].kernel == "qmatmul")
