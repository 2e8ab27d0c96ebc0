"""A layer's mixture of experts built from its tensors in the engine's weight format: on CUDA with
float weights the held experts stacked for the Triton grouped products (engine.model.triton_moe),
else each expert's products in the weight format (packed integer groups through the CPU kernels,
int8, or float) run one by one over their rows (engine.model.moe.ExpertLoop). The router and the
shared expert's gate stay float whatever the format (WeightFormat.unquantized)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import MoEConfig
from engine.model.moe import Expert, ExpertLoop, Experts, Gate, SparseMoE
from engine.model.product_plan import Band, ProductPlan
from engine.model.quantized import Weight
from engine.model.weight_formats import WeightFormat, dense


def build_moe(moe: MoEConfig, mlp: str, weights: Mapping[str, Weight], formats: WeightFormat, gate: Gate) -> SparseMoE:
    """The MoE of the layer whose MLP tensors are under `mlp` ("model.layers.N.mlp.")."""

    def expert(prefix: str, kind: str) -> Expert:
        def parts(*projections: str) -> list[tuple[str, Weight]]:
            return [(f"{prefix}{p}_proj.weight", weights[f"{prefix}{p}_proj.weight"]) for p in projections]

        return Expert(formats.product(f"{kind}_gate_up", parts("gate", "up")),
                      formats.product(f"{kind}_down", parts("down")), gate)

    experts: Experts
    if formats.device.type == "cuda" and formats.quantization == "none":
        experts = _triton_experts(moe, mlp, weights, formats, gate)
    else:
        experts = ExpertLoop({e: expert(f"{mlp}experts.{e}.", "expert") for e in moe.held})
    shared = expert(f"{mlp}shared_expert.", "shared_expert") if moe.shared_intermediate_size else None
    shared_gate = (formats.unquantized("shared_expert_gate", weights[f"{mlp}shared_expert_gate.weight"])
                   if moe.shared_gate else None)
    router = formats.unquantized("router", weights[f"{mlp}gate.weight"])
    return SparseMoE(moe, router, experts, shared, shared_gate)


def _triton_experts(moe: MoEConfig, mlp: str, weights: Mapping[str, Weight], formats: WeightFormat,
                    gate: Gate) -> Experts:
    from engine.model.triton_moe import TritonExperts  # Triton only where a GPU runs it

    def stacked(*projections: str) -> torch.Tensor:
        return torch.stack([torch.cat([dense(weights[f"{mlp}experts.{e}.{p}_proj.weight"], formats.dtype)
                                       for p in projections]) for e in moe.held]).to(formats.device)

    operand = f"{str(formats.dtype).removeprefix('torch.')}, experts stacked"
    for kind in ("expert_gate_up", "expert_down"):
        formats.plans.append((kind, ProductPlan((Band(1, "triton_grouped", operand),))))
    return TritonExperts(stacked("gate", "up"), stacked("down"), gate)
