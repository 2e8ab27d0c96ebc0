"""A mixture-of-experts MLP computed grouped by expert: no loop over tokens, one over the experts hit.

Route: the router's logits for every row, softmax in float32, the top k (renormalised where the model
says so). Group: the (row, expert) pairs sorted by expert once, so each expert's rows are one
contiguous slice of a gathered copy of the input. Compute: each expert hit runs its products (the
weight format's: packed integer groups, int8 or float, engine.model.weight_formats) once over all its
rows. Combine: the outputs scaled by their routing weights and summed into their rows with one
`index_add_`. Python runs once per expert hit, never per token; a batch of 32 rows over 8 experts
top-2 is 8 grouped products instead of HF's per-expert mask search and gather each time.

A shard holds a contiguous range of experts (expert parallelism) or every expert's share of the
intermediate features (tensor parallelism): its output is then a partial sum, which the model's
sharding all-reduces (engine.parallel.collectives), the routing being computed identically on every
rank from the same replicated input. Rows routed to experts held elsewhere add nothing here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import MoEConfig

Product = Callable[[torch.Tensor], torch.Tensor]
Gate = Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2I] -> silu(gate) * up [T, I]
# (the rows routed to held experts, sorted by expert; Routing.bounds; the held experts) -> each
# row's output of its expert: the per-expert loop here, or engine.model.triton_moe on CUDA
Experts = Callable[[torch.Tensor, list[int], range], torch.Tensor]


class Expert:
    """One SwiGLU expert: gate/up fused into one product, then down."""

    def __init__(self, gate_up: Product, down: Product, gate: Gate) -> None:
        self.gate_up = gate_up
        self.down = down
        self.gate = gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate(self.gate_up(x)))


class ExpertLoop:
    """Each held expert hit runs its products (its weight format's, engine.model.weight_formats)
    once over all its rows."""

    def __init__(self, experts: dict[int, Expert]) -> None:
        self.experts = experts

    def __call__(self, gathered: torch.Tensor, bounds: list[int], held: range) -> torch.Tensor:
        first = bounds[held.start]
        parts = [self.experts[e](gathered[bounds[e] - first : bounds[e + 1] - first])
                 for e in held if bounds[e + 1] > bounds[e]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def top_experts(logits: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top k experts ([T, k] each: their probabilities, renormalised over the k where the
    model says so, and their ids) from the router's logits, the softmax in float32."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, experts = torch.topk(probs, config.top_k, dim=-1)
    if config.normalize_top_k:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, experts


class Routing:
    """The (row, expert) pairs of a batch sorted by expert: `rows[i]` is the input row of pair i,
    `weights[i]` its routing weight; expert e's pairs are `bounds[e]:bounds[e + 1]`."""

    def __init__(self, logits: torch.Tensor, config: MoEConfig, dtype: torch.dtype) -> None:
        top, experts = top_experts(logits, config)
        top_k = config.top_k
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        self.rows = torch.div(order, top_k, rounding_mode="floor")
        self.weights = top.to(dtype).flatten().index_select(0, order).unsqueeze(1)
        counts = torch.bincount(flat, minlength=logits.shape[-1])
        # One host read for the whole step: every slice bound below is a Python int.
        self.bounds: list[int] = [0, *torch.cumsum(counts, 0).tolist()]


class SparseMoE:
    """The MoE MLP of one layer (see the module): `router` gives [T, num_experts] logits, `experts`
    computes the experts this shard holds, `shared` is the shared expert and `shared_gate` its
    [T, 1] gate logit (Qwen2-MoE), else None."""

    def __init__(self, config: MoEConfig, router: Product, experts: Experts,
                 shared: Expert | None = None, shared_gate: Product | None = None) -> None:
        self.config = config
        self.router = router
        self.experts = experts
        self.shared = shared
        self.shared_gate = shared_gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        one_row = x.shape[0] == 1 and isinstance(self.experts, ExpertLoop)
        out = self._one_row(x) if one_row else self._grouped(x)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out += shared
        return out

    def _one_row(self, x: torch.Tensor) -> torch.Tensor:
        """A batch-1 decode step's row: its k experts' outputs summed by their weights, without the
        sorting and gathering that only group rows (a dozen ops a layer a decode step pays in dispatch)."""
        top, experts = top_experts(self.router(x), self.config)
        weights = top[0].to(x.dtype).tolist()
        held = self.config.held
        loop = self.experts
        assert isinstance(loop, ExpertLoop)
        # In expert order, as the grouped path adds them.
        parts = [weight * loop.experts[expert](x)
                 for expert, weight in sorted(zip(experts[0].tolist(), weights, strict=True)) if expert in held]
        return torch.zeros_like(x) if not parts else parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        routing = Routing(self.router(x), self.config, x.dtype)
        held = self.config.held
        first, last = routing.bounds[held.start], routing.bounds[held.stop]
        out = torch.zeros_like(x)
        if last > first:
            computed = self.experts(x.index_select(0, routing.rows[first:last]), routing.bounds, held)
            out.index_add_(0, routing.rows[first:last], computed * routing.weights[first:last])
        return out
