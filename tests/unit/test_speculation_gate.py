"""The draft gate on the step costs of three kinds of CPU: it drafts where drafting raises the
expected tokens per second and not where it lowers them, learns a silent request's acceptance from
shadow drafts and probes, and starts a new request from the engine's acceptance."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.speculative.config import SpeculativeConfig
from engine.speculative.drafter import Drafter
from engine.speculative.gate import (
    MARGIN,
    CostCurve,
    DraftGate,
    StepCosts,
    acceptance_rate,
    draft_counts,
    record_verification,
)
from engine.speculative.ngram import NgramProposer
from engine.speculative.stats import SpecDecodeStats


def _costs(decode: dict[int, float], verify: dict[int, float]) -> StepCosts:
    """Costs timed on a quiet CPU, in ms."""
    ms = 1e-3
    return StepCosts(CostCurve(tuple(decode), tuple(s * ms for s in decode.values())),
                     CostCurve(tuple(verify), tuple(s / decode[1] for s in verify.values())), decode[1] * ms)


# Step times in ms by rows, in the shape each CPU has. AVX2 (AMD EPYC, calibrated at an engine's
# start): a step with drafts leaves the batch-decode kernel and every row up to 5 costs most of a
# step; rows 6 to 9 run on another product kernel and cost little more than 5.
AVX2 = _costs({1: 25.1, 2: 31.2, 4: 57.1}, {2: 41.2, 3: 59.6, 5: 86.5, 9: 87.7})
# AVX-512 without AMX (Intel Xeon, docs/benchmarks.md: a 9-row verification 21.2 ms, a step ~13 ms).
AVX512 = _costs({1: 13.2, 2: 14.5, 4: 17.0}, {2: 16.0, 3: 17.0, 5: 18.6, 9: 21.2})
# AMX (Intel Xeon): the tile products take a few rows for about the price of one.
AMX = _costs({1: 9.0, 2: 9.2, 4: 9.6}, {2: 9.8, 3: 9.9, 5: 10.2, 9: 11.0})
CPUS = {"avx2": AVX2, "avx512": AVX512, "amx": AMX}


def _expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a verification of `drafts` drafts yields on average: the step's own and each draft
    whose predecessors were all accepted."""
    return 1 + sum(rate ** j for j in range(1, drafts + 1))


def _speed(costs: StepCosts, rate: float, drafts: int) -> float:
    """Expected tokens per second of a lone request drafting `drafts` tokens a step."""
    seconds = costs.verify_s(1 + drafts) if drafts else costs.decode_s(1)
    return _expected_tokens(rate, drafts) / seconds


def _request(name: str = "a") -> Request:
    return Request(name, [1, 2, 3], SamplingParams(max_tokens=64), 1024)


@pytest.mark.parametrize("cpu", sorted(CPUS))
@pytest.mark.parametrize("rate", [0.05, 0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97])
def test_a_lone_request_drafts_the_number_that_is_fastest_and_none_where_drafting_loses(cpu, rate):
    costs = CPUS[cpu]
    (count,) = draft_counts([rate], [8], [False], 0, costs)
    best = max(range(9), key=lambda k: _speed(costs, rate, k))
    if _speed(costs, rate, best) > (1 + MARGIN) * _speed(costs, rate, 0):
        assert count == best
    else:
        assert count == 0


def test_where_drafting_pays_depends_on_the_cpu():
    """Chat-like acceptance pays where rows are cheap; copying pays on every CPU at 8 drafts (AVX2's
    6 to 9 rows are cheap) but not at 4 on AVX2."""
    chat, copying = 0.45, 0.9
    assert draft_counts([chat], [8], [False], 0, AMX)[0] >= 3
    assert draft_counts([chat], [8], [False], 0, AVX512)[0] > 0
    assert draft_counts([chat], [8], [False], 0, AVX2) == [0]
    assert all(draft_counts([copying], [8], [False], 0, costs)[0] >= 6 for costs in CPUS.values())
    assert draft_counts([0.6], [4], [False], 0, AVX2) == [0]
    assert draft_counts([0.6], [4], [False], 0, AMX) == [4]


def test_a_request_keeping_a_token_or_two_a_verification_stops_drafting_on_avx2():
    """The loss the gate fixes: verifications of 4 drafts keeping 1 or 2 of them (the old gate drafted
    on at a mean of one kept token) yield 2.5 tokens a step that costs 3.4 steps without drafts."""
    assert _expected_tokens(0.55, 4) * AVX2.decode_s(1) / AVX2.verify_s(5) < 0.75
    gate = DraftGate(AVX2, SpecDecodeStats())
    request = _request()
    for kept in (1, 2, 1, 2, 1, 2):
        record_verification(request, 4, kept)
    assert 0.5 < acceptance_rate(request, 0.5) < 0.65
    assert gate.counts([request], [4], 0) == [0]
    assert DraftGate(AMX, SpecDecodeStats()).counts([request], [4], 0) == [4]


def test_a_batch_drafts_only_as_far_as_the_steps_rows_pay():
    """Four copying requests and one writing freely: the drafts go to the copying ones; other
    running requests (prefilling) count as rows of the step."""
    rates, caps, probes = [0.9, 0.9, 0.9, 0.9, 0.1], [8] * 5, [False] * 5
    counts = draft_counts(rates, caps, probes, 0, AMX)
    assert counts[:4] == [counts[0]] * 4 and counts[0] > counts[4]
    assert draft_counts([0.3] * 4, [8] * 4, [False] * 4, 0, AVX2) == [0] * 4
    assert draft_counts([0.3], [8], [False], 3, AVX512) == [0] < draft_counts([0.3], [8], [False], 0, AVX512)


def test_a_silent_request_probes_with_one_draft_now_and_then():
    writing = SpecDecodeStats()
    for _ in range(20):
        writing.record(4, 0)
    for costs in (AVX2, AMX):
        gate = DraftGate(costs, writing)
        request = _request()
        for _ in range(6):
            record_verification(request, 4, 0)
        silent = 0
        while gate.counts([request], [8], 0) == [0]:
            silent += 1
        assert silent == gate.probe_interval
        assert gate.counts([request], [8], 0) == [1]  # until a verification resets the count
        record_verification(request, 1, 0)
        assert request.silent_steps == 0
    # A probe adds a fifth of a step or less to one on AMX, most of one on AVX2.
    assert DraftGate(AMX, SpecDecodeStats()).probe_interval < DraftGate(AVX2, SpecDecodeStats()).probe_interval


def test_a_new_request_starts_from_the_engines_acceptance():
    copying, writing = SpecDecodeStats(), SpecDecodeStats()
    for _ in range(20):
        copying.record(4, 4)
        writing.record(4, 0)
    assert DraftGate(AVX512, copying).counts([_request()], [8], 0) == [8]
    assert DraftGate(AVX512, writing).counts([_request()], [8], 0) == [0]


def test_cost_curves_interpolate_and_extend():
    curve = CostCurve((1, 3, 5), (1.0, 2.0, 4.0))
    assert [curve.at(r) for r in (1, 2, 3, 4, 5, 7)] == [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert CostCurve((2,), (3.0,)).at(4) == 6.0
    with pytest.raises(ValueError, match="ascending"):
        CostCurve((2, 2), (1.0, 1.0))
    with pytest.raises(ValueError, match="one time for each"):
        CostCurve((1, 2), (1.0,))


def _copying(drafter: Drafter, passage: list[int], follows: bool, steps: int) -> int | None:
    """Decode a request whose prompt ends by starting the passage over, one token a step (the passage's
    next one if `follows`, else a token that is nowhere in it); the steps until it drafts (None: never)."""
    request = Request("a", [*passage, passage[0]], SamplingParams(max_tokens=64), 1024)
    for step in range(steps):
        request.num_computed_tokens = request.num_tokens - 1
        drafter.draft([request])
        if request.draft_token_ids:
            return step
        request.append_output(passage[request.num_tokens - len(passage)] if follows else 7)
    return None


def test_a_silent_request_learns_from_shadow_drafts_and_starts_drafting():
    """On AVX2, in a new engine: a request copying a passage drafts after a shadow or two, its n-gram
    drafts scored without verifying them; one writing freely never does (its probes aside: none
    within the probe interval)."""
    spec = SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1)
    passage = list(range(100, 160))
    gate = DraftGate(AVX2, SpecDecodeStats())
    assert _copying(Drafter(spec, NgramProposer(1, 2), gate), passage, True, 40) <= 16
    assert _copying(Drafter(spec, NgramProposer(1, 2), gate), passage, False, gate.probe_interval) is None


def test_a_start_up_timing_that_others_slowed_changes_no_decision_and_steps_served_correct_it():
    """Workers start together, so a start-up timing may find the CPU busy: one step of one row
    timed at 1.6 times its cost once made drafts look cheap at chat acceptance on AVX2. Verifications
    are priced in steps of one row, so the same bets are taken either way; the fastest step served
    at each timed count corrects the time, and a slower one changes nothing."""
    busy = replace(AVX2, decode=CostCurve((1, 2, 4), (1.6 * 25.1e-3, *AVX2.decode.seconds[1:])))
    for rate in (0.45, 0.6, 0.75, 0.9):
        assert draft_counts([rate], [8], [False], 0, busy) == draft_counts([rate], [8], [False], 0, AVX2)
    gate = DraftGate(busy, SpecDecodeStats())
    gate.observe(1, 1, 30e-3)
    assert gate.costs.decode == busy.decode.faster(1, 30e-3)
    gate.observe(1, 1, 25.1e-3)
    gate.observe(1, 1, 40e-3)
    assert gate.costs.decode == AVX2.decode


def test_verifications_served_move_their_cost_toward_what_they_cost_beside_the_one_row_steps():
    """The start-up timing keeps each count's fastest step; served between one-row steps a
    verification costs more (AMD EPYC: 9 rows 4.5 steps of one against 3.9 timed), and bets priced
    on the start-up table lost on chat. Verifications served move the ratio toward theirs, measured
    against the recent one-row steps, up or down, so a CPU busy at start-up or now changes nothing;
    a step of r rows never counts as more than r steps of one."""
    gate = DraftGate(AVX2, SpecDecodeStats())
    copying = _request()
    for kept in (8, 6, 8, 7, 8, 5):
        record_verification(copying, 8, kept)
    assert gate.counts([copying], [8], 0) == [8]
    for _ in range(12):  # on a CPU now twice as busy: one-row steps and 9-row ones alike
        for _ in range(3):
            gate.observe(1, 1, 2 * 25.1e-3)
        gate.observe(1, 9, 2 * 87.7e-3)
    assert gate.costs.verify_s(9) == pytest.approx(AVX2.verify_s(9), rel=0.02)
    before = gate.costs.verify_s(5)
    for _ in range(12):  # quiet again, and 9 rows dearer than timed: 7 steps of one row
        for _ in range(3):
            gate.observe(1, 1, 25.1e-3)
        gate.observe(1, 9, 7 * 25.1e-3)
    assert gate.costs.verify_steps.at(9) == pytest.approx(7, rel=0.05)
    assert gate.costs.verify_s(5) == before  # another count's ratio is its own
    assert 0 < gate.counts([copying], [8], 0)[0] < 8  # the 9-row bet no longer pays
    gate.observe(1, 2, 99.0)
    assert gate.costs.verify_steps.at(2) <= 2


def test_a_step_with_no_decoding_request_asks_the_gate_nothing():
    """A step of prompts only (every request still waiting or prefilling) drafts nothing."""
    drafter = Drafter(SpeculativeConfig(), NgramProposer(2, 4), DraftGate(AVX2, SpecDecodeStats()))
    drafter.draft([])
    prefilling = _request()
    drafter.draft([prefilling])
    assert prefilling.draft_token_ids == [] and prefilling.shadow_token_ids == []


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_a_batch_with_drafts_costs_at_least_the_plain_batch_and_each_ones_drafts(cpu):
    costs = CPUS[cpu]
    for drafts in ([8], [8, 0], [4, 4, 0, 1], [8] * 7):
        sequences = len(drafts)
        least = costs.decode_s(sequences) + sum(costs.verify_s(1 + n) - costs.decode_s(1) for n in drafts if n)
        assert costs.step_s(sequences, drafts) >= least - 1e-12
    assert costs.step_s(3, [0, 0, 0]) == costs.decode_s(3)
