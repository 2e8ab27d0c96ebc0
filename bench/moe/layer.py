"""The per-expert reference the moe suite times the engine's grouped MoE layer against: what
transformers' MixtralSparseMoeBlock (MixtralExperts.forward) does in a decode step, written here so
that the engine never carries it. For each expert hit it finds that expert's rows by a one-hot mask,
gathers them, runs F.linear over fp32 gate/up and down weights, and adds the weighted rows back with
its own index_add_: a mask search, a gather and a scatter per expert, every step."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from engine.config import MoEConfig
from engine.model.quantized import QuantizedWeight


class ReferenceMoE:
    """One layer's MoE in fp32 as transformers computes it (see the module)."""

    def __init__(self, config: MoEConfig, router: torch.Tensor, gate_up: list[torch.Tensor],
                 down: list[torch.Tensor]) -> None:
        self.config = config
        self.router = router  # [experts, hidden]
        self.gate_up = gate_up  # per expert [2I, hidden]: gate rows, then up rows
        self.down = down  # per expert [hidden, I]

    @classmethod
    def from_weights(cls, config: MoEConfig, weights: Mapping[str, torch.Tensor | QuantizedWeight],
                     layer: int) -> ReferenceMoE:
        """Layer `layer`'s MoE from HF-named weights (as engine.model.loader reads them), in fp32."""
        def fp32(name: str) -> torch.Tensor:
            weight = weights[f"model.layers.{layer}.mlp.{name}.weight"]
            return (weight.dequantize() if isinstance(weight, QuantizedWeight) else weight).float().contiguous()

        experts = range(config.num_experts)
        return cls(config, fp32("gate"),
                   [torch.cat((fp32(f"experts.{e}.gate_proj"), fp32(f"experts.{e}.up_proj"))) for e in experts],
                   [fp32(f"experts.{e}.down_proj") for e in experts])

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        probs = torch.softmax(F.linear(x, self.router), dim=-1)
        top, index = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.normalize_top_k:
            top = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(index, num_classes=self.config.num_experts).permute(2, 1, 0)  # [experts, k, rows]
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = int(expert[0])
            slot, rows = torch.where(mask[e])
            gate, up = F.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            hidden = F.linear(F.silu(gate) * up, self.down[e]) * top[rows, slot, None]
            out.index_add_(0, rows, hidden)
        return out


def layer_input(batch: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A decode step's normed hidden rows: unit RMS, as the post-attention RMSNorm leaves them."""
    return torch.randn(batch, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
