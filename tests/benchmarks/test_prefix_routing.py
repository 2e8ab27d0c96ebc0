"""The prefix_routing suite's plan and arithmetic: which gateway each turn reaches, the modes'
alternating phases, a phase's figures from its requests and counters, and the medians' ratios."""

from __future__ import annotations

import itertools
import math

import pytest

from bench.common.chat_replay import gateway_of
from bench.suites.prefix_routing import RATIOS, medians, parse_args, phase_modes, ratios, summary


def test_a_conversations_consecutive_turns_reach_different_gateways_and_every_gateway_starts_some():
    for conversation in range(5):
        path = [gateway_of(conversation, turn, 2) for turn in range(4)]
        assert all(a != b for a, b in itertools.pairwise(path))
    assert {gateway_of(conversation, 0, 2) for conversation in range(4)} == {0, 1}
    assert [gateway_of(0, turn, 3) for turn in range(4)] == [0, 1, 2, 0]


def test_the_modes_alternate_exact_first_and_a_run_needs_a_phase_of_each(capsys):
    assert phase_modes(5) == ["exact", "approximate", "exact", "approximate", "exact"]
    assert parse_args(["--quick"]).phases == 2
    with pytest.raises(SystemExit):
        parse_args(["--phases", "1"])
    assert "--phases: at least 2" in capsys.readouterr().err


def _phase(mode: str, ttfts: list[tuple[int, float, int, int]], queries: float, hits: float) -> dict:
    requests = [{"turn": turn, "gateway": 0, "ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached}
                for turn, ttft, prompt, cached in ttfts]
    return {"mode": mode, "requests": requests, "placements": {"aggregated": 3.0},
            "worker_counters": {"vllm:prefix_cache_queries_total": queries, "vllm:prefix_cache_hits_total": hits}}


def test_a_phase_counts_later_turns_for_cached_share_and_ttft_and_first_turns_as_the_load_control():
    phase = _phase("exact", [(1, 0.5, 100, 0), (1, 0.7, 100, 16), (2, 0.2, 200, 150), (2, 0.4, 300, 150),
                             (3, 0.3, 400, 300)], queries=1000.0, hits=600.0)
    figures = summary(phase)
    assert figures["hit_rate"] == pytest.approx(0.6)
    assert figures["cached_share"] == pytest.approx(600 / 900)  # turns 2 and 3 only
    assert figures["ttft_p50_s"] == pytest.approx(0.3)
    assert figures["first_ttft_p50_s"] == pytest.approx(0.6)
    # No query at all (a run where no worker saw a prompt) is a rate of 0, not a division by zero.
    assert summary(_phase("exact", [(1, 0.1, 10, 0), (2, 0.1, 10, 0), (2, 0.1, 10, 0)], 0.0, 0.0))["hit_rate"] == 0


def test_each_figure_is_the_median_over_a_modes_phases_and_the_ratio_is_exact_over_approximate():
    exact = medians([dict.fromkeys(RATIOS, value) for value in (1.0, 3.0, 2.0)])
    approximate = medians([dict.fromkeys(RATIOS, value) for value in (4.0, 4.0)])
    assert exact == dict.fromkeys(RATIOS, 2.0)
    assert ratios({"exact": exact, "approximate": approximate}) == dict.fromkeys(RATIOS, 0.5)
    assert math.isnan(ratios({"exact": exact, "approximate": dict.fromkeys(RATIOS, 0.0)})["hit_rate"])
