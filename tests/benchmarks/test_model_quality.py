"""The fidelity measures themselves, on examples small enough to work out by hand: the perplexity of
next-token predictions, the evenly spaced spans of a text, and where two greedy outputs fork."""

from __future__ import annotations

import math

import pytest
import torch

from bench.common.model_quality import FIXED_TEXT, first_difference, next_token_nlls, perplexity_of, spans


def test_perplexity_of_hand_worked_predictions():
    # Row 0: two equal logits, so p(token 0) = 1/2. Row 1: logits (ln 3, 0), so p(token 1) = 1/(3 + 1).
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    nll = float(next_token_nlls(logits, [0, 1]).sum())
    assert nll == pytest.approx(math.log(2.0) + math.log(4.0))
    assert perplexity_of(nll, 2) == pytest.approx(math.sqrt(8.0))  # exp((ln 2 + ln 4) / 2)


def test_a_uniform_guess_over_v_tokens_has_perplexity_v_and_a_certain_one_1():
    uniform = torch.zeros(3, 4)
    assert perplexity_of(float(next_token_nlls(uniform, [0, 3, 2]).sum()), 3) == pytest.approx(4.0)
    certain = torch.tensor([[50.0, 0.0, 0.0], [0.0, 0.0, 50.0]])
    assert perplexity_of(float(next_token_nlls(certain, [0, 2]).sum()), 2) == pytest.approx(1.0)


def test_low_precision_logits_are_scored_in_fp32():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert float(next_token_nlls(logits.to(torch.bfloat16), [1])[0]) == pytest.approx(math.log(4 / 3), rel=1e-2)


def test_perplexity_of_no_prediction_is_refused():
    with pytest.raises(ValueError, match="0 predictions"):
        perplexity_of(0.0, 0)


def test_spans_run_from_the_start_to_the_end_and_centred_ones_fall_between():
    ids = list(range(100))
    assert spans(ids, 3, 10) == [list(range(0, 10)), list(range(45, 55)), list(range(90, 100))]
    assert spans(ids, 3, 10, centred=True) == [list(range(15, 25)), list(range(45, 55)), list(range(75, 85))]
    with pytest.raises(ValueError, match="fewer than one span"):
        spans(ids[:5], 1, 10)


def test_first_difference_is_the_fork_index_or_the_length():
    assert first_difference([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3


def test_the_fixed_text_is_committed_with_the_bench():
    text = FIXED_TEXT.read_text(encoding="utf-8")
    assert text.startswith("Chapter 1. Hacker Slang and Hacker Culture")
    assert len(text) == 55_377  # bench/texts/README.md: never edited, so recorded figures stay comparable
