"""The step-time model: the fit recovers a linear law, stays non-negative, and predicts chunked prefill."""

from __future__ import annotations

import random

import pytest

from services.common.step_model import StepModel, StepModelFit

TRUE = StepModel(base_s=0.050, per_prompt_token_s=0.004, per_sequence_s=0.002, per_context_token_s=0.00001)


def test_the_fit_recovers_a_linear_law_from_mixed_steps() -> None:
    rng = random.Random(1)
    fit = StepModelFit()
    for _ in range(200):
        prompt = rng.choice([0, 0, 16, 64, 256])
        sequences = rng.randrange(0, 16) if prompt else rng.randrange(1, 16)
        context = sequences * rng.randrange(50, 500)
        noise = 1 + rng.uniform(-0.02, 0.02)
        fit.record(prompt, sequences, context, TRUE.step_s(prompt, sequences, context) * noise)
    model = fit.model
    assert model.base_s == pytest.approx(TRUE.base_s, rel=0.15)
    assert model.per_prompt_token_s == pytest.approx(TRUE.per_prompt_token_s, rel=0.05)
    assert model.per_sequence_s == pytest.approx(TRUE.per_sequence_s, rel=0.25)
    assert model.step_s(128, 8, 2000) == pytest.approx(TRUE.step_s(128, 8, 2000), rel=0.05)


def test_coefficients_never_go_negative() -> None:
    fit = StepModelFit()
    # More sequences, less time: noise that an unconstrained fit would read as a negative cost.
    for sequences, seconds in [(1, 0.060), (2, 0.059), (4, 0.058), (8, 0.057)] * 5:
        fit.record(0, sequences, 0, seconds)
    model = fit.model
    assert min(model.base_s, model.per_prompt_token_s, model.per_sequence_s, model.per_context_token_s) >= 0
    assert model.step_s(0, 4, 0) == pytest.approx(0.058, rel=0.05)


def test_empty_steps_are_ignored_and_an_empty_fit_is_unknown() -> None:
    fit = StepModelFit()
    fit.record(0, 0, 0, 1.0)
    fit.record(10, 0, 0, 0.0)
    assert fit.samples == 0
    assert not fit.model.known


def test_recent_steps_outweigh_old_ones() -> None:
    fit = StepModelFit()
    for _ in range(300):
        fit.record(0, 1, 100, 0.050)
    for _ in range(1500):
        fit.record(0, 1, 100, 0.100)  # the machine got busier
    assert fit.model.step_s(0, 1, 100) == pytest.approx(0.100, rel=0.05)


def test_chunked_prefill_pays_one_step_base_per_chunk() -> None:
    model = StepModel(base_s=0.05, per_prompt_token_s=0.004, per_sequence_s=0.002)
    assert model.prefill_s(0, 64) == 0.0
    # 200 tokens in chunks of 64: 4 steps, each beside 3 decoding sequences.
    assert model.prefill_s(200, 64, sequences=3) == pytest.approx(4 * (0.05 + 3 * 0.002) + 200 * 0.004)


def test_speculating_steps_teach_the_time_per_token() -> None:
    fit = StepModelFit(speculation_max_batch=4)
    for _ in range(300):
        # Two sequences, four draft rows each, three tokens gained each: the steps cost the drafts.
        fit.record(8, 2, 400, TRUE.step_s(8, 2, 400))
        fit.record_speculation(2, 8, 6)
        fit.record(0, 6, 1200, TRUE.step_s(0, 6, 1200))  # a batch too large to speculate
        fit.record_speculation(6, 0, 6)
    model = fit.model
    assert model.draft_rows_per_sequence == pytest.approx(4.0, rel=0.01)
    assert model.tokens_per_decode_step == pytest.approx(3.0, rel=0.01)
    assert model.token_s(2, 400) == pytest.approx(TRUE.step_s(8, 2, 400) / 3, rel=0.05)
    assert model.token_s(6, 1200) == pytest.approx(TRUE.step_s(0, 6, 1200), rel=0.05)  # no drafts at 4 and up
    # Without speculation a token takes one step.
    assert TRUE.token_s(3, 100) == TRUE.step_s(0, 3, 100)
