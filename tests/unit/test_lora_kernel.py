"""The CPU kernels' lora_add_ (engine/model/kernels/lora_bgmv.cpp), LoRA's products by adapter slot,
against the per-row product in torch for every build this CPU runs: fp32 and bf16 weights, fp32 and
bf16 outputs, ranks below the slots' width and not a multiple of 8, an empty slot, output widths not
a multiple of 8 (an uneven tensor-parallel split) and more rows of a slot than one register tile."""

from __future__ import annotations

import pytest
import torch

from engine.lora.batch import LoraBatch
from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable

VARIANTS = [variant.name for variant in runnable(cpu_flags())]


def _case(slots: int, width: int, ranks: list[int], in_outs: list[tuple[int, int]], dtype: torch.dtype,
          seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], torch.Tensor]:
    """Random modules' A [in, slots, width] and B [slots, width, out] (zero past each slot's rank, as
    the slots hold them), their first columns, and x."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(size_in, slots, width, generator=gen) / 8 for size_in, _ in in_outs]
    b = [torch.randn(slots, width, out, generator=gen) / 8 for _, out in in_outs]
    for slot, rank in enumerate(ranks):
        for module_a, module_b in zip(a, b, strict=True):
            module_a[:, slot, rank:] = 0
            module_b[slot, rank:] = 0
    columns, start = [], 0
    for _, out in in_outs:
        columns.append(start)
        start += out
    x = torch.randn(40, in_outs[0][0], generator=gen)
    return [t.to(dtype) for t in a], [t.to(dtype) for t in b], columns, x.to(dtype)


def _expected(y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], columns: list[int],
              row_slots: list[int | None]) -> torch.Tensor:
    """Row by row in fp64: each row's own slot's (x·A)·B added to y."""
    out = y.double().clone()
    for row, slot in enumerate(row_slots):
        if slot is None:
            continue
        for module_a, module_b, start in zip(a, b, columns, strict=True):
            term = (x[row].double() @ module_a[:, slot].double()) @ module_b[slot].double()
            out[row, start:start + module_b.shape[2]] += term
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("dtype", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize(("width", "ranks", "in_outs"), [
    (16, [16, 8, 0, 5], [(96, 64), (96, 24), (96, 24)]),  # q, k, v of a small model; slot 2 empty
    (24, [24, 17, 3], [(70, 37), (70, 13)]),  # uneven widths: an odd split, two vectors and a tail
], ids=["qkv", "uneven"])
def test_each_row_gets_its_own_slots_term_alone(variant, dtype, out_dtype, width, ranks, in_outs):
    a, b, columns, x = _case(len(ranks), width, ranks, in_outs, dtype, seed=width)
    # 40 rows: the base's, each slot's (slot 0 with more rows than a register tile), in turns.
    row_slots: list[int | None] = [None if row % 7 == 3 else (0 if row < 20 else row % len(ranks))
                                   for row in range(40)]
    row_slots = [None if slot is not None and ranks[slot] == 0 and row % 2 else slot
                 for row, slot in enumerate(row_slots)]
    batch = LoraBatch.of([(slot, 1) for slot in row_slots], width, dtype, kernel=True)
    assert batch.order is not None and batch.segments is not None
    y = torch.randn(40, sum(out for _, out in in_outs) + 5, generator=torch.Generator().manual_seed(9)).to(out_dtype)
    expected = _expected(y, x, a, b, columns, row_slots)
    got = y.clone()
    kernels(variant).lora_add_(got, x, a, b, columns, batch.order, batch.segments, ranks)
    # fp32: only the sums' order and fused multiply-adds differ from fp64's; bf16 out: one rounding of
    # the sum (2^-8 relative), far below a term added from the wrong slot or not at all.
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[out_dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(got[:, -5:], y[:, -5:])  # columns past the modules' untouched
    base_rows = [row for row, slot in enumerate(row_slots) if slot is None or ranks[slot] == 0]
    assert torch.equal(got[base_rows], y[base_rows])
    assert not torch.allclose(got.double(), y.double(), rtol=tolerance, atol=tolerance)


def test_refuses_a_width_not_a_multiple_of_eight():
    a, b, columns, x = _case(2, 12, [12, 4], [(16, 8)], torch.float32, seed=1)
    batch = LoraBatch.of([(0, 2), (1, 2)], 12, torch.float32, kernel=True)
    assert batch.order is not None and batch.segments is not None
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels().lora_add_(torch.zeros(40, 8), x, a, b, columns, batch.order, batch.segments, [12, 4])


@pytest.mark.parametrize(("order", "segments", "error"), [
    ([0, 40], [(0, 0, 2)], "not a row of x"),
    ([0, 1], [(2, 0, 2)], "outside the slots"),
    ([0, 1], [(0, 1, 3)], "outside the slots or the order"),
], ids=["row", "slot", "end"])
def test_refuses_indices_outside_x_the_slots_or_the_order(order, segments, error):
    a, b, columns, x = _case(2, 8, [8, 4], [(16, 8)], torch.float32, seed=2)
    with pytest.raises(RuntimeError, match=error):
        kernels().lora_add_(torch.zeros(40, 8), x, a, b, columns, torch.tensor(order), torch.tensor(segments),
                            [8, 4])
