"""The CPU kernels' argmax_rows (engine/model/kernels/argmax.cpp), greedy decoding's pick, against
torch.argmax for every build this CPU runs, and the sampler's use of it."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable
from engine.sampler import greedy_tokens

VARIANTS = [variant.name for variant in runnable(cpu_flags())]
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("columns", [1, 3, 8, 9, 23, 49152, 49155])
def test_argmax_rows_picks_what_torch_argmax_picks(variant, columns):
    # Coarse values (eighths in a small range) make ties between lanes and within a lane common.
    gen = torch.Generator().manual_seed(columns)
    logits = torch.randint(-40, 40, (6, columns), generator=gen).float() / 8
    got = kernels(variant).argmax_rows(logits)
    assert got.dtype == torch.long
    assert got.tolist() == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_ties_nan_and_infinities_follow_torch(variant):
    logits = torch.zeros(8, 40)
    logits[0, 5] = logits[0, 13] = logits[0, 21] = 1.0  # a tie within one lane: its first column
    logits[1, 8] = logits[1, 7] = 2.0  # the lower column sits in the later lane (7 against lane 0's 8)
    logits[2, 3], logits[2, 17], logits[2, 35] = 5.0, NAN, NAN  # the first NaN wins
    logits[3, 0] = NAN  # a NaN in the first column
    logits[4] = -INF  # all minus infinity: column 0
    logits[5, 38], logits[5, 39] = INF, INF
    logits[6, 39] = NAN  # in the scalar tail
    logits[7, 36] = 1e-30  # only the tail holds the maximum
    assert kernels(variant).argmax_rows(logits).tolist() == logits.argmax(dim=1).tolist() == [
        5, 7, 17, 0, 0, 38, 39, 36]


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_may_be_a_slice_of_wider_padded_logits(variant):
    padded = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    padded[:, 50:] = 100.0  # padding columns past the vocabulary must not be seen
    view = padded[:, :50]
    assert kernels(variant).argmax_rows(view).tolist() == view.argmax(dim=1).tolist()


def test_bad_logits_are_refused_by_name():
    ops = kernels()
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous columns"):
        ops.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 0))


def test_greedy_tokens_take_the_kernel_on_cpu_and_torch_for_other_dtypes(monkeypatch):
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(4))
    calls = []
    ops = kernels()
    real = ops.argmax_rows
    monkeypatch.setattr(type(ops), "argmax_rows", lambda self, x: calls.append(x.shape) or real(x))
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=1).tolist()
    assert calls == [(3, 100)]
    half = logits.to(torch.bfloat16)
    assert greedy_tokens(half).tolist() == half.argmax(dim=1).tolist()
    assert calls == [(3, 100)]
