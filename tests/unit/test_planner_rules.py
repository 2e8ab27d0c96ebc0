"""The planner's rules: replicas per pool from demand and measured capacity, bounds, and damping."""

from __future__ import annotations

import pytest

from services.gateway.planner_rules import (
    DecodeDemand,
    PlannerConfig,
    PoolBounds,
    PrefillDemand,
    ScaleDecision,
    decode_replicas,
    prefill_replicas,
)

CONFIG = PlannerConfig(queue_drain_s=1.0, tpot_s=0.1, target_utilisation=0.8, kv_target_utilisation=0.8,
                       prefill=PoolBounds(1, 8), decode=PoolBounds(1, 8))


def prefill(arrival: float = 0.0, queued: int = 0, speed: float = 500.0) -> PrefillDemand:
    return PrefillDemand(arrival_tokens_per_s=arrival, queued_prompt_tokens=queued, tokens_per_s_per_replica=speed)


def decode(sequences: int = 0, used: int = 0, blocks: int = 500, batch: float = 0.0, tpot: float = 0.0) -> DecodeDemand:
    return DecodeDemand(sequences=sequences, used_kv_blocks=used, kv_blocks_per_replica=blocks,
                        batch_per_replica=batch, tpot_s=tpot)


def test_prefill_covers_the_arrival_rate_with_square_root_headroom():
    # 1000 tokens/s at 500 tokens/s a replica is a load of 2: 2 + 0.6 x sqrt(2) = 2.85 -> 3.
    assert prefill_replicas(prefill(arrival=1000), CONFIG) == 3
    # A load of 9: 9 + 0.6 x 3 = 10.8 -> 11.
    assert prefill_replicas(prefill(arrival=4500), PlannerConfig(prefill=PoolBounds(1, 64))) == 11
    exact = PlannerConfig(prefill_headroom_beta=0.0, prefill=PoolBounds(1, 8))
    assert prefill_replicas(prefill(arrival=1000), exact) == 2, "beta 0: the load alone"


def test_prefill_headroom_shrinks_as_the_pool_grows():
    # A fixed 80% utilisation gives every pool 25% over its load; square-root staffing gives a
    # small pool more (its bursts are large against it) and a large one less.
    config = PlannerConfig(prefill=PoolBounds(1, 64))
    loads = (1, 4, 16, 36)
    replicas = [prefill_replicas(prefill(arrival=load * 500.0), config) for load in loads]
    assert replicas == [2, 6, 19, 40]
    headroom = [count / load - 1 for count, load in zip(replicas, loads, strict=True)]
    assert headroom == sorted(headroom, reverse=True) and headroom[0] > headroom[-1]
    assert replicas[1] > 4 / 0.8, "a small pool: more than 80% utilisation would run"
    assert replicas[-1] < 36 / 0.8, "a large pool: fewer than 80% utilisation would run"


def test_prefill_also_drains_the_queue_within_the_drain_time():
    # 2000 queued tokens to compute within 1 s add 2000 / 500 = 4 replicas: 2.85 + 4 = 6.85 -> 7.
    assert prefill_replicas(prefill(arrival=1000, queued=2000), CONFIG) == 7
    relaxed = PlannerConfig(queue_drain_s=4.0, prefill=PoolBounds(1, 8))
    assert prefill_replicas(prefill(arrival=1000, queued=2000), relaxed) == 4  # 2.85 + 1 = 3.85


def test_the_queue_asks_for_no_more_replicas_than_it_holds_prompts():
    # 2 queued prompts of 2000 tokens would ask for 4000 / 500 = 8 replicas within 1 s; each is
    # computed by one replica, so 2 at most, on top of the arrival rate's 2.85: 4.85 -> 5.
    queued = PrefillDemand(arrival_tokens_per_s=1000, queued_prompt_tokens=4000, tokens_per_s_per_replica=500,
                           queued_requests=2)
    assert prefill_replicas(queued, CONFIG) == 5
    assert prefill_replicas(prefill(arrival=1000, queued=4000), CONFIG) == 8, "prompt count unknown: no cap"


def test_the_default_drain_time_asks_only_for_replicas_that_arrive_before_the_queue_is_gone():
    # Regression: draining within 1 s, 40 queued prompts of 1200 tokens asked for 40 more replicas
    # (here the bound, 8); new replicas take minutes to be ready, so the default drains within
    # 120 s: 48000 / 120 / 500 = 0.8 more on top of the arrival rate's 2.85 -> 4.
    queued = PrefillDemand(arrival_tokens_per_s=1000, queued_prompt_tokens=48_000, tokens_per_s_per_replica=500,
                           queued_requests=40)
    assert PlannerConfig().queue_drain_s == 120.0
    assert prefill_replicas(queued, PlannerConfig(prefill=PoolBounds(1, 8))) == 4
    assert prefill_replicas(queued, CONFIG) == 8


def test_prefill_stays_within_bounds_and_waits_for_a_measurement():
    assert prefill_replicas(prefill(arrival=0), CONFIG) == 1
    assert prefill_replicas(prefill(arrival=100_000), CONFIG) == 8
    assert prefill_replicas(prefill(arrival=1000, speed=0.0), CONFIG) is None


def test_decode_keeps_kv_usage_under_its_target():
    # 900 used blocks over replicas of 500 blocks at 0.8: 2.25 -> 3.
    assert decode_replicas(decode(used=900), CONFIG) == 3
    assert decode_replicas(decode(used=400), CONFIG) == 1


def test_decode_holds_the_sequences_within_the_tpot_target():
    # 10 sequences per replica measured at 50 ms; at a 100 ms target one replica holds 20, planned
    # at 0.8 -> 16: 40 sequences need 2.5 -> 3 replicas.
    assert decode_replicas(decode(sequences=40, used=10, batch=10, tpot=0.05), CONFIG) == 3
    # Slower than the target already: a replica holds fewer than it runs now.
    assert decode_replicas(decode(sequences=20, used=10, batch=10, tpot=0.2), CONFIG) == 5


def test_decode_sizes_from_the_step_model_once_fitted():
    # Steps of 60 ms + 15 ms a sequence reach 100 ms at 8/3 sequences: 26.7 tokens/s a replica.
    # 12 sequences stepping at 90 ms are 133 tokens/s: 5 replicas at full use, 6.25 -> 7 at 0.8.
    fitted = DecodeDemand(sequences=12, used_kv_blocks=10, kv_blocks_per_replica=500, batch_per_replica=2,
                          tpot_s=0.09, step_base_s=0.06, step_per_sequence_s=0.015)
    assert decode_replicas(fitted, CONFIG) == 7
    # A fixed cost over the target: one sequence a replica, at 5 tokens/s; 3 / 0.2 s = 15 tokens/s
    # need 3 replicas, 3.75 -> 4 at 0.8.
    slow = DecodeDemand(sequences=3, used_kv_blocks=10, kv_blocks_per_replica=500, batch_per_replica=1,
                        tpot_s=0.2, step_base_s=0.15, step_per_sequence_s=0.05)
    assert decode_replicas(slow, CONFIG) == 4


def test_an_over_provisioned_decode_pool_is_sized_by_its_token_rate_not_its_few_sequences():
    # Regression: 17 replicas stepping at 26 ms (24 ms + 5.6 ms a sequence, batch 0.3) hold only 4
    # sequences; sized by sequences (13.6 a replica at 100 ms) the pool fell to 1 replica, which
    # could not keep up, then jumped back up, every few minutes (the planner_sim suite). Their
    # 154 tokens/s need 1.13 replicas at 136 tokens/s each: 1.41 -> 2 at 0.8.
    idle = DecodeDemand(sequences=4, used_kv_blocks=10, kv_blocks_per_replica=500, batch_per_replica=0.3,
                        tpot_s=0.026, step_base_s=0.024, step_per_sequence_s=0.0056)
    assert decode_replicas(idle, CONFIG) == 2


def test_decode_takes_the_larger_of_the_kv_and_sequence_needs():
    assert decode_replicas(decode(sequences=40, used=1900, batch=10, tpot=0.05), CONFIG) == 5
    # Without a TPOT measurement only the KV rule applies.
    assert decode_replicas(decode(sequences=400, used=10), CONFIG) == 1


def test_decode_stays_within_bounds_and_waits_for_a_report():
    assert decode_replicas(decode(used=100_000), CONFIG) == 8
    assert decode_replicas(decode(used=10, blocks=0), CONFIG) is None


def test_scale_up_is_immediate():
    decision = ScaleDecision(window_s=300, cooldown_s=0)
    assert decision.decide(0, recommended=5, current=2) == 5


def test_scale_down_waits_for_a_full_window_and_takes_its_highest_recommendation():
    decision = ScaleDecision(window_s=300, cooldown_s=0)
    assert decision.decide(0, recommended=6, current=6) == 6
    assert decision.decide(100, recommended=2, current=6) == 6, "window not yet observed"
    assert decision.decide(200, recommended=4, current=6) == 6
    # At 300 s the window holds 6, 2, 4 and 3: the highest, 6, is what runs.
    assert decision.decide(300, recommended=3, current=6) == 6
    # At 301 s the 6 has left the window: down to its highest remaining recommendation, 4.
    assert decision.decide(301, recommended=3, current=6) == 4


def test_an_old_high_recommendation_never_scales_up():
    decision = ScaleDecision(window_s=60, cooldown_s=0)
    decision.decide(0, recommended=9, current=3)
    assert decision.decide(60, recommended=2, current=3) == 3  # 9 is in the window but above what runs


def test_no_change_within_the_cooldown_of_the_last_one():
    decision = ScaleDecision(window_s=0, cooldown_s=60)
    assert decision.decide(0, recommended=4, current=2) == 4
    assert decision.decide(30, recommended=6, current=4) == 4
    assert decision.decide(30, recommended=1, current=4) == 4
    assert decision.decide(61, recommended=6, current=4) == 6


@pytest.mark.parametrize("kwargs", [
    {"queue_drain_s": 0}, {"tpot_s": -1}, {"interval_s": 0}, {"target_utilisation": 0}, {"kv_target_utilisation": 1.5},
    {"cooldown_s": -1}, {"scale_down_window_s": -5}, {"prefill_headroom_beta": -0.1},
])
def test_config_refuses_out_of_range_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PlannerConfig(**kwargs)


@pytest.mark.parametrize("bounds", [(3, 2), (-1, 2), (0, 0)])
def test_bounds_refuse_inverted_or_empty_ranges(bounds):
    with pytest.raises(ValueError, match="replicas"):
        PoolBounds(*bounds)
