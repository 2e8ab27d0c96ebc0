"""Tests for the Sampler: filters, penalties, min_tokens, greedy, logprobs, seeded draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.sampler import (
    Sampler,
    SamplingRequestState,
    TokenLogprobs,
    allowed_tokens,
    apply_filters,
    apply_penalties,
    greedy_tokens,
)
from engine.sampling_params import SamplingParams

# Probabilities chosen so that no top-p / min-p threshold below sits on a boundary.
PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)


def _kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(~logits.reshape(-1).isneginf()).flatten().tolist())


def _state(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRequestState:
    return SamplingRequestState(params, list(prompt), list(output), generator)


@pytest.mark.parametrize(
    ("top_k", "kept"),
    [(2, {1, 3}), (1, {1}), (4, {1, 2, 3, 4}), (0, {0, 1, 2, 3, 4}), (-1, {0, 1, 2, 3, 4}), (99, {0, 1, 2, 3, 4})],
)
def test_top_k_keeps_exactly_the_k_best(top_k: int, kept: set[int]):
    assert _kept(apply_filters(_logits(PROBS), [SamplingParams(top_k=top_k)])) == kept


def test_top_k_keeps_ties_with_the_kth_best():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert _kept(apply_filters(logits, [SamplingParams(top_k=1)])) == {1, 2}


@pytest.mark.parametrize(("top_p", "kept"), [(0.3, {1}), (0.6, {1, 3}), (0.75, {1, 3, 4}), (0.9, {1, 2, 3, 4})])
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, kept: set[int]):
    assert _kept(apply_filters(_logits(PROBS), [SamplingParams(top_p=top_p)])) == kept


def test_top_p_stops_as_soon_as_mass_reaches_p():
    # Four equal tokens have exact probabilities 0.25: two of them reach p = 0.5 exactly.
    assert len(_kept(apply_filters(torch.zeros(1, 4), [SamplingParams(top_p=0.5)]))) == 2


def test_top_p_of_one_keeps_even_negligible_tokens():
    logits = torch.cat([torch.zeros(1, 5), torch.full((1, 5000), -40.0)], dim=1)
    assert len(_kept(apply_filters(logits, [SamplingParams(top_p=1.0)]))) == 5005


@pytest.mark.parametrize(("min_p", "kept"), [(0.3, {1, 3, 4}), (0.2, {1, 2, 3, 4}), (0.9, {1}), (0.0, {0, 1, 2, 3, 4})])
def test_min_p_drops_tokens_below_fraction_of_best(min_p: float, kept: set[int]):
    assert _kept(apply_filters(_logits(PROBS), [SamplingParams(min_p=min_p)])) == kept


def test_top_p_applies_to_what_top_k_kept():
    # Alone, p=0.8 needs {1, 3, 4}; after top-3 renormalises, 0.4/0.85 + 0.3/0.85 already reaches it.
    assert _kept(apply_filters(_logits(PROBS), [SamplingParams(top_p=0.8)])) == {1, 3, 4}
    assert _kept(apply_filters(_logits(PROBS), [SamplingParams(top_k=3, top_p=0.8)])) == {1, 3}


def test_min_p_applies_after_top_p():
    # min-p first would renormalise to {1, 3, 4} and let top-p 0.8 cut token 4.
    assert _kept(apply_filters(_logits(PROBS), [SamplingParams(top_p=0.8, min_p=0.3)])) == {1, 3, 4}


def test_filters_are_per_row():
    logits = _logits(PROBS).repeat(3, 1)
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(min_p=0.3)]
    filtered = apply_filters(logits, params)
    assert [_kept(row) for row in filtered] == [{1, 3}, {0, 1, 2, 3, 4}, {1, 3, 4}]
    kept_values = filtered[~filtered.isneginf()]
    assert torch.equal(kept_values, logits[~filtered.isneginf()])


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalised = apply_penalties(logits, [_state(params, prompt=[0], output=[1, 1, 2])])
    # token 0: prompt only -> 2/2; token 1: -1*2 - 2*0.25 - 0.5; token 2: 0.5/2 - 0.25 - 0.5.
    assert penalised.tolist() == [[1.0, -3.0, -0.5, -3.0, 1.0]]


def test_penalties_leave_unpenalised_rows_alone_in_sample():
    sampler = Sampler(vocab_size=2, eos_token_ids=[])
    logits = torch.tensor([[3.0, 2.0], [3.0, 2.0]])
    states = [
        _state(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0]),
        _state(SamplingParams(temperature=0.0), prompt=[0]),
    ]
    assert [token for token, _ in sampler.sample(logits, states)] == [1, 0]


def test_frequency_penalty_changes_greedy_choice():
    sampler = Sampler(vocab_size=3, eos_token_ids=[])
    logits = torch.tensor([[1.0, 0.8, 0.0]])
    state = _state(SamplingParams(temperature=0.0, frequency_penalty=0.15), output=[0, 0])
    assert sampler.sample(logits, [state])[0][0] == 1


def test_min_tokens_blocks_eos_and_stop_token_ids():
    sampler = Sampler(vocab_size=6, eos_token_ids=[5])
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(4,))
    assert sampler.sample(logits, [_state(params, output=[0, 0])])[0][0] == 3
    assert sampler.sample(logits, [_state(params, output=[0, 0, 0])])[0][0] == 5


def test_min_tokens_does_not_block_ignored_eos():
    sampler = Sampler(vocab_size=4, eos_token_ids=[3])
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits, [_state(params)])[0][0] == 3


def test_min_tokens_never_masks_everything():
    sampler = Sampler(vocab_size=3, eos_token_ids=[2])
    logits = torch.tensor([[float("-inf"), float("-inf"), 0.0]])
    assert sampler.sample(logits, [_state(SamplingParams(temperature=0.0, min_tokens=5))])[0][0] == 2


def test_min_tokens_blocks_eos_when_sampling():
    sampler = Sampler(vocab_size=3, eos_token_ids=[2])
    logits = torch.tensor([[0.0, 0.0, 10.0]]).repeat(200, 1)
    states = [_state(SamplingParams(min_tokens=1))] * 200
    assert all(token != 2 for token, _ in sampler.sample(logits, states))


def test_greedy_is_argmax():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(vocab_size=300, eos_token_ids=[0])
    result = sampler.sample(logits, [_state(SamplingParams(temperature=0.0))] * 8)
    assert result == [(token, None) for token in logits.argmax(dim=1).tolist()]


def test_padding_columns_past_vocab_are_ignored():
    logits = torch.tensor([[0.0, 1.0, 50.0, 50.0]])
    sampler = Sampler(vocab_size=2, eos_token_ids=[])
    assert sampler.sample(logits, [_state(SamplingParams(temperature=0.0))])[0][0] == 1
    assert sampler.sample(logits, [_state(SamplingParams(temperature=1.0, logprobs=1))])[0][1].top[0][0] == 1


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = torch.log_softmax(logits.float(), dim=1)
    states = [
        _state(SamplingParams(temperature=0.7, repetition_penalty=1.5, top_k=5, logprobs=4), prompt=[1, 2, 3]),
        _state(SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=0), output=[7]),
        _state(SamplingParams(temperature=0.0)),
    ]
    result = Sampler(vocab_size=50, eos_token_ids=[0]).sample(logits, states)
    first, second, third = (lp for _, lp in result)
    assert isinstance(first, TokenLogprobs) and isinstance(second, TokenLogprobs) and third is None
    for row, (token, lp) in enumerate(result[:2]):
        assert lp.token_id == token
        assert math.isclose(lp.logprob, expected[row, token].item(), abs_tol=1e-6)
    best = expected[0].topk(4)
    assert [t for t, _ in first.top] == best.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert second.top == ()


def _seeded_sequence(seed: int, row: int, batch: int, steps: int = 20) -> list[int]:
    """Tokens a seeded request gets over `steps`, sitting at `row` among `batch - 1` random others."""
    vocab = 1000
    sampler = Sampler(vocab_size=vocab, eos_token_ids=[0], seed=row * 31 + batch)
    own = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, repetition_penalty=1.1, seed=seed)
    logits_source = torch.Generator().manual_seed(1234)
    others = torch.Generator().manual_seed(row * 1000 + batch)
    other_params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.5, seed=7)]
    output: list[int] = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=others) * 3
        logits[row] = torch.randn(vocab, generator=logits_source) * 2
        states = []
        for i in range(batch):
            if i == row:
                states.append(_state(params, prompt=[1, 2], output=output, generator=own))
            else:
                p = other_params[i % 3]
                gen = torch.Generator().manual_seed(i) if p.seed is not None else None
                states.append(_state(p, prompt=[3], output=[i], generator=gen))
        output.append(sampler.sample(logits, states)[row][0])
    return output


def test_seeded_request_is_reproducible_whatever_its_batch():
    alone = _seeded_sequence(seed=42, row=0, batch=1)
    assert _seeded_sequence(seed=42, row=0, batch=8) == alone
    assert _seeded_sequence(seed=42, row=5, batch=16) == alone
    assert _seeded_sequence(seed=43, row=0, batch=1) != alone
    assert len(set(alone)) > 5


def test_shared_generator_is_seeded_by_sampler_seed():
    logits = torch.zeros(16, 100)
    states = [_state(SamplingParams())] * 16
    first = Sampler(vocab_size=100, eos_token_ids=[], seed=5).sample(logits, states)
    again = Sampler(vocab_size=100, eos_token_ids=[], seed=5).sample(logits, states)
    other = Sampler(vocab_size=100, eos_token_ids=[], seed=6).sample(logits, states)
    assert first == again and first != other


# Temperature 0.5 squares the probabilities [.1, .2, .3, .4]; top-k 3 then removes token 0.
_TARGET = [0.0, 0.04 / 0.29, 0.09 / 0.29, 0.16 / 0.29]


def _frequencies(tokens: list[int]) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(4)]


def test_shared_draws_follow_filtered_distribution():
    draws = 4000
    logits = _logits([0.1, 0.2, 0.3, 0.4]).repeat(draws, 1)
    states = [_state(SamplingParams(temperature=0.5, top_k=3))] * draws
    tokens = [t for t, _ in Sampler(vocab_size=4, eos_token_ids=[], seed=3).sample(logits, states)]
    assert _frequencies(tokens) == pytest.approx(_TARGET, abs=0.03)
    assert 0 not in tokens


def test_seeded_draws_follow_filtered_distribution():
    draws = 4000
    logits = _logits([0.1, 0.2, 0.3, 0.4]).repeat(draws, 1)
    params = SamplingParams(temperature=0.5, top_k=3, seed=0)
    states = [_state(params, generator=torch.Generator().manual_seed(i)) for i in range(draws)]
    tokens = [t for t, _ in Sampler(vocab_size=4, eos_token_ids=[]).sample(logits, states)]
    assert _frequencies(tokens) == pytest.approx(_TARGET, abs=0.03)
    assert 0 not in tokens


def test_rejects_row_count_mismatch():
    with pytest.raises(ValueError):
        Sampler(vocab_size=4, eos_token_ids=[]).sample(torch.zeros(2, 4), [_state(SamplingParams())])


def test_advance_resumes_a_seeded_sequence_elsewhere():
    vocab = 200
    sampler = Sampler(vocab_size=vocab, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, seed=11)
    step_logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(4))

    def run(generator: torch.Generator, steps: range) -> list[int]:
        return [sampler.sample(step_logits[i : i + 1], [_state(params, generator=generator)])[0][0] for i in steps]

    whole = run(torch.Generator().manual_seed(11), range(10))
    resumed = torch.Generator().manual_seed(11)
    sampler.advance(resumed, 4)
    assert run(resumed, range(4, 10)) == whole[4:]
    assert run(torch.Generator().manual_seed(11), range(4, 10)) != whole[4:]


def test_rejects_logits_narrower_than_vocab():
    with pytest.raises(ValueError):
        Sampler(vocab_size=8, eos_token_ids=[]).sample(torch.zeros(1, 4), [_state(SamplingParams())])


def test_caller_logits_are_not_modified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    before = logits.clone()
    params = SamplingParams(top_k=2, repetition_penalty=2.0, min_tokens=1, logprobs=2)
    Sampler(vocab_size=4, eos_token_ids=[3]).sample(logits, [_state(params, prompt=[0, 1])])
    assert torch.equal(logits, before)


def test_greedy_tokens_pick_what_argmax_picks_on_ties_and_nan():
    logits = torch.zeros(4, 49152)
    logits[0, 5] = logits[0, 700] = 1.0  # a tie: the first
    logits[1] = 3.0  # all equal: index 0
    logits[2, 3], logits[2, 100] = 5.0, float("nan")  # NaN wins, as in argmax
    logits[3, 49151] = -1.0
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=1).tolist() == [5, 0, 100, 0]


def test_a_grammar_bitmask_allows_exactly_its_set_bits_and_masks_only_its_rows():
    rng = np.random.default_rng(0)
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    words = [rng.integers(-2**31, 2**31, size=3, dtype=np.int64).astype(np.int32) for _ in range(2)]
    allowed = allowed_tokens(words, vocab, torch.device("cpu"))
    expected = [[bool((int(row[t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for row in words]
    assert allowed.tolist() == expected
    sampler = Sampler(vocab, [0])
    logits = torch.randn(3, vocab)
    states = [SamplingRequestState(SamplingParams(temperature=0.0), [1], [], None, allowed=words[0]),
              SamplingRequestState(SamplingParams(temperature=0.0), [1], [], None),
              SamplingRequestState(SamplingParams(temperature=1.0, seed=1), [1], [], None, allowed=words[1])]
    first, free, drawn = (token for token, _ in sampler.sample(logits, states))
    assert expected[0][first] and first == int(logits[0].masked_fill(~allowed[0], float("-inf")).argmax())
    assert free == int(logits[1].argmax()) and expected[1][drawn]


def test_logit_bias_moves_only_its_tokens_and_leaves_the_reported_logprobs_raw():
    sampler = Sampler(8, [0])
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.5, 0.1, 0.2, 0.3]] * 2)
    pushed = SamplingParams(temperature=0.0, logit_bias=((6, 100.0), (2, -100.0)), logprobs=1)
    plain = SamplingParams(temperature=0.0, logprobs=1)
    (biased, biased_lp), (free, free_lp) = sampler.sample(
        logits, [SamplingRequestState(pushed, [1], [], None), SamplingRequestState(plain, [1], [], None)])
    assert (biased, free) == (6, 2)
    assert biased_lp.top == free_lp.top  # logprobs of the model's own distribution, as vLLM reports them
