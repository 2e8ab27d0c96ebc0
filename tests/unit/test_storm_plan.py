"""The cancellation storm's plan (harness/storm.py): shared prefixes, the API mix, and
where clients cancel."""

from __future__ import annotations

from collections import Counter

import pytest

from harness.storm import BLOCK_TOKENS, POINTS, StormConfig, plan_storm


def test_plan_mixes_apis_and_cancellation_points_over_shared_prefixes():
    config = StormConfig(requests=1000, seed=3)
    plan = plan_storm(config, calm_ttft_s=0.5)
    assert plan == plan_storm(config, calm_ttft_s=0.5)  # the seed decides everything
    points = Counter(p.point for p in plan)
    assert 400 < points[None] < 600 and all(120 < points[point] < 220 for point in POINTS), points
    assert 180 < sum(p.request.api == "http" for p in plan) < 320
    prefixes = Counter(p.request.token_ids[: config.prefix_blocks * BLOCK_TOKENS] for p in plan)
    assert len(prefixes) == config.prefixes
    assert len({p.request.token_ids for p in plan}) > 990  # suffixes make prompts (almost all) distinct
    for planned in plan:
        request = planned.request
        assert config.max_tokens[0] <= request.max_tokens <= config.max_tokens[1]
        if planned.point == "before_prefill":
            assert request.cancel_after_s == 0.0
        elif planned.point == "during_transfer":
            assert 0.0 <= request.cancel_after_s <= 1.0
        elif planned.point == "mid_decode":
            assert 1 <= request.cancel_after_chunks < request.max_tokens
        else:
            assert request.cancel_after_s is None and request.cancel_after_chunks is None


@pytest.mark.parametrize("field, value", [("requests", 0), ("cancel_fraction", 1.5), ("http_fraction", -0.1),
                                          ("max_tokens", (1, 4)), ("suffix_tokens", (5, 2))])
def test_config_refuses_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        StormConfig(**{field: value})
