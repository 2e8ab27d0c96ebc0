"""The start-up profile fits a usable step model and leaves the engine empty, in every role."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from services.common.startup_profile import profile_engine
from services.common.step_model import StepModelFit


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_the_profile_measures_steps_and_holds_no_blocks_afterwards(make_engine, role):
    engine = make_engine(role=role, cache=CacheConfig(num_blocks=64))
    fit = StepModelFit()
    profile_engine(engine, fit)
    assert fit.samples >= 2
    assert fit.model.per_prompt_token_s > 0
    if role != "prefill":
        assert fit.model.step_s(0, 1, 100) > 0
    # Nothing left running or held: the prefill role's handed-off requests were released too.
    assert not engine.has_unfinished()
    assert engine.stats().kv_usage == 0


def test_a_cache_too_small_for_the_profile_skips_what_does_not_fit(make_engine):
    engine = make_engine(role="decode", cache=CacheConfig(num_blocks=4))
    fit = StepModelFit()
    profile_engine(engine, fit)  # 192-token prompts need 13 blocks: skipped, not an error
    assert fit.samples > 0
    assert not engine.has_unfinished() and engine.stats().kv_usage == 0
