"""The planner simulation's world (bench/planner/world.py): the day's demand curve, the prefill
queue, the decode steady state, the per-minute SLO rule and the oracle."""

from __future__ import annotations

from collections import deque

import pytest

from bench.planner.world import (
    Capacity,
    Demand,
    PrefillPool,
    Request,
    Targets,
    decode_steady_state,
    minute_attains,
    oracle_decode,
    oracle_prefill,
    serve_fifo,
)

CAPACITY = Capacity(prefill_tokens_per_s=256.0, decode_base_s=0.06, decode_per_sequence_s=0.015)
TARGETS = Targets(ttft_s=2.0, tpot_s=0.1)


def test_the_rate_peaks_at_hour_14_and_bottoms_at_a_tenth_of_the_peak_12_hours_away():
    demand = Demand(peak_rate=3.0)
    rates = [demand.rate(minute) for minute in range(demand.minutes)]
    assert max(range(len(rates)), key=rates.__getitem__) // 60 == 13  # the peak is 14:00, between minutes 839 and 840
    assert max(rates) == pytest.approx(3.0, rel=1e-4)
    assert min(rates) == pytest.approx(0.3, rel=1e-4)
    assert min(range(len(rates)), key=rates.__getitem__) // 60 in (1, 2)


def test_prompts_switch_from_256_to_1024_tokens_at_hour_12():
    demand = Demand()
    assert (demand.prompt_tokens(719), demand.prompt_tokens(720)) == (256, 1024)
    arrivals = demand.arrivals()
    assert {r.prompt_tokens for r in arrivals[719]} == {256} and {r.prompt_tokens for r in arrivals[720]} == {1024}


def test_arrivals_are_poisson_around_the_rate_and_the_same_for_the_same_seed():
    demand = Demand(peak_rate=2.0, hours=24, seed=7)
    arrivals = demand.arrivals()
    counts = [len(minute) for minute in arrivals]
    expected = sum(demand.rate(minute) * 60 for minute in range(demand.minutes))
    assert sum(counts) == pytest.approx(expected, rel=0.02)
    assert len(set(counts)) > 10, "counts vary from minute to minute"
    assert all(60 * m <= r.arrival_s < 60 * (m + 1) for m, minute in enumerate(arrivals) for r in minute)
    assert [len(m) for m in Demand(peak_rate=2.0, seed=7).arrivals()] == counts
    assert [len(m) for m in Demand(peak_rate=2.0, seed=8).arrivals()] != counts


def test_the_prefill_queue_serves_in_order_and_carries_what_cannot_start_to_the_next_minute():
    pool = PrefillPool(speed=256.0)
    pool.resize(1, 0.0)
    requests = [Request(float(t), 2560, 0) for t in (0, 1, 50)]  # 10 s each on one replica
    assert [r.ttft_s for r in pool.run(requests, until_s=60.0)] == [10.0, 19.0, 10.0]
    pool = PrefillPool(speed=256.0)
    pool.resize(1, 0.0)
    backlog = [Request(float(t), 7680, 0) for t in (0, 1, 2)]  # 30 s each: the third starts at 60 s
    assert len(pool.run(backlog, until_s=60.0)) == 2
    assert pool.queued_prompt_tokens == 7680
    pool.resize(2, 60.0)
    assert [r.ttft_s for r in pool.run([], until_s=120.0)] == [88.0]


def test_serve_fifo_uses_the_replica_free_soonest():
    requests = deque(Request(0.0, 512, 0) for _ in range(3))  # 2 s each
    served = serve_fifo([0.0, 1.0], requests, 256.0, until_s=10.0)
    assert [r.prefilled_s for r in served] == [2.0, 3.0, 4.0]


def test_decode_steady_state_follows_littles_law_and_fails_past_saturation():
    # 1 request/s, 63 steps each, on 2 replicas: S = 63 x 0.06 / (1 - 63 x 0.015 / 2) = 7.17.
    sequences, tpot = decode_steady_state(1.0, 2, 64, CAPACITY)
    assert sequences == pytest.approx(3.78 / 0.5275, rel=1e-6)
    assert tpot == pytest.approx(0.06 + 0.015 * sequences / 2)
    assert decode_steady_state(2.2, 2, 64, CAPACITY) == (float("inf"), float("inf"))
    assert decode_steady_state(0.0, 1, 64, CAPACITY) == (0.0, 0.06)


def test_the_decode_oracle_takes_the_fewest_replicas_within_the_tpot_target():
    # TPOT <= 100 ms means <= 8/3 sequences a replica; at rate r that is n >= 63 x r x 0.0375 = 2.3625 r.
    assert oracle_decode(1.0, 64, CAPACITY, TARGETS) == 3
    assert oracle_decode(3.0, 64, CAPACITY, TARGETS) == 8
    assert oracle_decode(0.0, 64, CAPACITY, TARGETS) == 1
    with pytest.raises(ValueError, match="TPOT"):
        oracle_decode(1.0, 64, CAPACITY, Targets(tpot_s=0.05))


def test_the_prefill_oracle_covers_the_minutes_tokens_and_the_ttft_of_90_percent():
    # 10 prompts of 1 s each arriving together: one replica each gets all of them within 2 s only
    # with 5 replicas (two rounds); 4 would leave 2 of 10 at 3 s.
    burst = [Request(0.0, 256, 0) for _ in range(10)]
    assert oracle_prefill(burst, 0.0, CAPACITY, TARGETS) == 5
    # Spread out, one replica computes them all at once on arrival.
    spread = [Request(6.0 * i, 256, 0) for i in range(10)]
    assert oracle_prefill(spread, 0.0, CAPACITY, TARGETS) == 1
    # Prompts that alone take 4 s never meet 2 s: the throughput bound, 60 x 1024 / (256 x 60) = 4.
    heavy = [Request(float(i), 1024, 0) for i in range(60)]
    assert oracle_prefill(heavy, 0.0, CAPACITY, TARGETS) == 4
    assert oracle_prefill([], 0.0, CAPACITY, TARGETS) == 1


def test_a_minute_attains_when_90_percent_of_its_requests_meet_both_targets():
    def request(ttft: float, tpot: float | None) -> Request:
        return Request(0.0, 256, 0, prefilled_s=ttft, tpot_s=tpot)

    good = [request(1.0, 0.09)] * 9
    assert minute_attains([*good, request(3.0, 0.09)], TARGETS)
    assert not minute_attains([*good[:8], request(3.0, 0.09), request(1.0, 0.2)], TARGETS)
    assert not minute_attains([*good[:8], request(1.0, None), Request(0.0, 256, 0)], TARGETS)
    assert minute_attains([], TARGETS)
