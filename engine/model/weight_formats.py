"""Which weight format serves the model's matrix products (`--quantization`), and each product built in it.

Each format is one kind of product chosen at load, so the model code never branches on it:

- "none": float weights in the model's dtype (a file's integer blocks dequantized exactly), as
  `Linear` (engine.model.linear) prepares them for `EngineConfig.cpu_weights`;
- "gguf", "gptq", "awq" (the checkpoint's own integer groups): the GGUF file's blocks
  (engine.model.gguf_blocks) or a GPTQ/AWQ checkpoint's packed layers (engine.model.gptq_awq)
  through the CPU kernels (`QuantizedLinear`; where `cpu_weights` is "fp16", inputs of a few rows
  and more take fbgemm's product over an fp16 copy); tensors whose groups no kernel takes on the device
  (GPTQ/AWQ off CPU, a group size the kernels cannot step through, a GGUF block type no loader
  maps) are served dequantized and named in a start-up warning, never silently;
- "int8": every product's float weight (a GGUF file's dequantized, or an HF checkpoint's)
  rounded to int8 per output channel at load (engine.model.int8), the LM head included.

The tied embedding and LM head (SmolLM2 ties them; the file stores them as Q8_0) stay one tensor:
under "gguf" the head is the kernel's product over the file's Q8_0 blocks (it is a fifth of a
decode step's weight bytes) and the lookup dequantizes just the rows it needs, exactly; under
"int8" both read the one int8 copy. An untied embedding is a lookup, not a product: it keeps the
file's values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from engine.config import CpuWeights
from engine.model.int8 import quantize_int8
from engine.model.kernels import Kernels, kernels
from engine.model.kernels.packing import has_kernel
from engine.model.linear import Linear
from engine.model.product_plan import ProductPlan, has_fp16_product, plan_dense, plan_quantized
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import DenseEmbedding, QuantizedEmbedding, QuantizedLinear

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight
Product = Callable[[torch.Tensor], torch.Tensor]
OWN_GROUPS = ("gguf", "gptq", "awq")  # serve the integer groups the checkpoint holds
SERVED = ("none", "int8", *OWN_GROUPS)  # what WeightFormat builds; "auto" resolves to one of them


def choose_quantization(requested: str, stored_as: str | None, device: str) -> str:
    """The format to serve for a checkpoint whose weights are `stored_as` integer groups (None: float
    weights; quant_config.check_requested has refused a flag that contradicts the checkpoint).
    "auto": the checkpoint's own groups, where the CPU kernels serve a GGUF file's on CPU, and a
    GPTQ/AWQ checkpoint's everywhere (dequantized where no kernel takes them); else "none".
    ValueError naming the flag for an explicit format this checkpoint or device cannot take."""
    cpu = torch.device(device).type == "cpu"
    if requested == "auto":
        if stored_as in ("gptq", "awq"):
            return stored_as if not cpu or _kernels_build(required=False) else "none"
        if stored_as == "gguf" and cpu and _kernels_build(required=False):
            return "gguf"
        return "none"
    if requested == "gguf" and stored_as != "gguf":
        raise ValueError("quantization: 'gguf' serves a GGUF file's own integer blocks; this checkpoint has none "
                         "(supported for it: auto, none, int8)")
    if requested in ("gguf", "int8") and not cpu:
        raise ValueError(f"quantization: {requested!r} has CPU kernels only (supported on {device}: auto, none)")
    if requested != "none" and cpu:
        _kernels_build(required=True, requested=requested)
    return requested


def _kernels_build(required: bool, requested: str = "auto") -> bool:
    try:
        kernels()
    except RuntimeError as error:
        if required:
            raise ValueError(f"quantization: {requested!r} needs the CPU kernels, which could not be built: "
                             f"{error}") from error
        log.warning("quantization auto: the CPU kernels could not be built, so the checkpoint's integer groups are "
                    "served dequantized (quantization none): %s", error)
        return False
    return True


def dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a float tensor in `dtype` (integer groups dequantized exactly, then cast)."""
    return (weight.dequantize() if isinstance(weight, QuantizedWeight) else weight).to(dtype)


class ConcatenatedProducts:
    """Products over row blocks of one fused weight whose blocks cannot share a layout (their
    outputs side by side)."""

    def __init__(self, products: Sequence[Product]) -> None:
        self.products = list(products)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([product(x) for product in self.products], dim=-1)


class WeightFormat:
    """Builds the products and embeddings of one model in one format (see the module docstring), each
    product with its plan (engine.model.product_plan), which `plans` lists by layer kind."""

    def __init__(self, quantization: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                 cpu_weights: CpuWeights = "plain", int8_parts: int = 0, ops: Kernels | None = None) -> None:
        """`ops`: the kernels' build integer-group products run on (None: this CPU's best)."""
        if quantization not in SERVED:
            raise ValueError(f"quantization: {quantization!r} is not one of {', '.join(SERVED)}")
        self.quantization = quantization
        self.dtype = dtype
        self.device = torch.device(device)
        self.cpu_weights = cpu_weights
        self.int8_parts = int8_parts  # integer-group products' int8 parts per activation (0: none)
        self.ops = ops
        self.dequantized: list[str] = []  # tensors whose integer groups no kernel takes here, served dense
        self.plans: list[tuple[str, ProductPlan]] = []  # (layer kind, plan) of every product built

    def product(self, kind: str, parts: Sequence[tuple[str, Weight]], bias: torch.Tensor | None = None) -> Product:
        """y = x·Wᵀ (+ bias) for W the rows of `parts` (HF name, weight) stacked in order; `kind` names
        the layer kind ("qkv", "lm_head", ...) in `plans`."""
        runs = self._runs(parts)
        products: list[Product] = []
        first = 0
        for run in runs:
            rows = sum(weight.shape[0] for _, weight in run)
            products.append(self._single(kind, run, None if bias is None else bias[first : first + rows]))
            first += rows
        return products[0] if len(products) == 1 else ConcatenatedProducts(products)

    def unquantized(self, kind: str, weight: Weight) -> Product:
        """y = x·Wᵀ over `weight` in float whatever the format: a MoE router, whose few rows decide
        which experts run (vLLM and llama.cpp's converters keep it unquantized too)."""
        values = dense(weight, self.dtype).to(self.device)
        # Never rounded to fp16 (`--cpu-weights fp16`): a routing flip changes a token's experts. Never
        # packed for oneDNN either: its call costs more than a product of a few hundred weights a row.
        plan = plan_dense(values, "plain")
        self.plans.append((kind, plan))
        return Linear(values, plan)

    def tied(self, name: str, weight: Weight) -> tuple[Callable[[torch.Tensor], torch.Tensor], Product]:
        """The embedding lookup and the LM head over one tied weight, sharing its storage."""
        if self.quantization == "int8":
            quantized = quantize_int8(dense(weight, torch.float32))
            return QuantizedEmbedding(quantized, self.dtype), self._quantized("lm_head", quantized)
        head = self.product("lm_head", [(name, weight)])
        if isinstance(head, QuantizedLinear) and isinstance(weight, QuantizedWeight):
            return QuantizedEmbedding(weight, self.dtype), head
        assert isinstance(head, Linear)
        return DenseEmbedding(head.weight), head

    def embedding(self, weight: Weight) -> Callable[[torch.Tensor], torch.Tensor]:
        """An untied embedding: the file's values, integer groups kept where the format keeps them."""
        if isinstance(weight, QuantizedWeight) and self.quantization != "none":
            return QuantizedEmbedding(weight, self.dtype)
        return DenseEmbedding(dense(weight, self.dtype).to(self.device))

    def _runs(self, parts: Sequence[tuple[str, Weight]]) -> list[list[tuple[str, Weight]]]:
        # Serving own groups, consecutive parts fuse while their layouts agree; other formats fuse all.
        if self.quantization not in OWN_GROUPS:
            return [list(parts)]
        runs: list[list[tuple[str, Weight]]] = []
        for name, weight in parts:
            if isinstance(weight, QuantizedWeight) and not (self.device.type == "cpu" and has_kernel(weight)):
                self.dequantized.append(name)
                weight = weight.dequantize()
            if runs and _same_layout(runs[-1][-1][1], weight):
                runs[-1].append((name, weight))
            else:
                runs.append([(name, weight)])
        return runs

    def _single(self, kind: str, run: list[tuple[str, Weight]], bias: torch.Tensor | None) -> Product:
        weights = [weight for _, weight in run]
        if self.quantization == "int8":
            stacked = torch.cat([dense(weight, torch.float32) for weight in weights])
            return self._quantized(kind, quantize_int8(stacked), bias)
        if self.quantization in OWN_GROUPS and isinstance(weights[0], QuantizedWeight):
            return self._quantized(kind, _stack(weights), bias)  # type: ignore[arg-type]
        stacked = torch.cat([dense(weight, self.dtype) for weight in weights]).to(self.device)
        plan = plan_dense(stacked, self.cpu_weights)
        self.plans.append((kind, plan))
        return Linear(stacked, plan, None if bias is None else bias.to(self.device))

    def _quantized(self, kind: str, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantizedLinear:
        # Larger inputs take fbgemm's fp16 product where float32 weights would be held at fp16.
        fp16_copy = self.cpu_weights == "fp16" and has_fp16_product()
        plan = plan_quantized(weight, self.dtype, fp16_copy, self.int8_parts, self._bf16_instruction())
        self.plans.append((kind, plan))
        return QuantizedLinear(weight, plan, bias, self.ops)

    def _bf16_instruction(self) -> str | None:
        """The kernels' bf16 GEMM this CPU runs faster (timed once, on first use), where bf16 products
        may take one."""
        if self.dtype != torch.bfloat16 or self.int8_parts:
            return None
        chosen = (kernels() if self.ops is None else self.ops).bf16_products
        return None if chosen is None else chosen.instruction


def _same_layout(a: Weight, b: Weight) -> bool:
    if not isinstance(a, QuantizedWeight) or not isinstance(b, QuantizedWeight):
        return not isinstance(a, QuantizedWeight) and not isinstance(b, QuantizedWeight)
    return ((a.bits, a.group_size, a.q.dtype, a.offset is None) == (b.bits, b.group_size, b.q.dtype, b.offset is None)
            and (a.perm is None) == (b.perm is None) and (a.perm is None or torch.equal(a.perm, b.perm)))


def _stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    if len(weights) == 1:
        return weights[0]
    first = weights[0]
    offsets = [w.offset for w in weights]
    return QuantizedWeight(
        q=torch.cat([w.q for w in weights]),
        scale=torch.cat([w.scale for w in weights]),
        offset=None if first.offset is None else torch.cat(offsets),  # type: ignore[arg-type]
        bits=first.bits,
        group_size=first.group_size,
        perm=first.perm,
    )
