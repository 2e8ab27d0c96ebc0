"""The Triton grouped expert products (engine.model.triton_moe) compute what the per-expert loop
computes, over rows sorted by expert with experts hit by none, one or several tiles' rows and a
shard's held range (Triton's interpreter without a GPU; shapes kept small for it)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.config import MoEConfig
from engine.model.llama import silu_mul
from engine.model.moe import Expert, ExpertLoop, SparseMoE
from engine.model.triton_moe import TritonExperts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, EXPERTS = 48, 40, 6


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("held", [range(0, 6), range(2, 5)])
def test_grouped_products_equal_the_per_expert_loop(rows: int, held: range) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).to(DEVICE)
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).to(DEVICE)
    router = torch.randn(EXPERTS, HIDDEN, generator=gen).to(DEVICE)
    config = MoEConfig(num_experts=EXPERTS, top_k=2, intermediate_size=INTER, normalize_top_k=True,
                       experts_held=(held.start, held.stop))
    loop = ExpertLoop({e: Expert(lambda x, w=gate_up[e]: x @ w.T, lambda x, w=down[e]: x @ w.T, silu_mul)
                       for e in held})
    grouped = TritonExperts(gate_up[held.start:held.stop], down[held.start:held.stop], silu_mul)
    x = torch.randn(rows, HIDDEN, generator=gen).to(DEVICE)
    expected = SparseMoE(config, lambda h: h @ router.T, loop)(x)
    got = SparseMoE(config, lambda h: h @ router.T, grouped)(x)
    assert torch.allclose(got, expected, atol=1e-3, rtol=1e-4)
