"""The soak suite's flat-memory rule: RSS fitted over the last two thirds of the run, against
max(32 MiB, 5% of the median RSS there)."""

from __future__ import annotations

import pytest

from bench.suites.soak import rss_growth

MIB = 1 << 20


def test_flat_memory_with_noise_passes():
    samples = [(t, 1000 * MIB + (t // 15 % 3) * MIB) for t in range(0, 1800, 15)]  # 0, 1, 2 MiB over
    grown, allowed = rss_growth(samples)
    assert abs(grown) < MIB and allowed == pytest.approx(0.05 * 1001 * MIB)


def test_steady_growth_fails():
    samples = [(t, 1000 * MIB + t * MIB // 10) for t in range(0, 1800, 15)]  # 6 MiB a minute
    grown, allowed = rss_growth(samples)
    assert grown > allowed and abs(grown - 120 * MIB) < 2 * MIB


def test_growth_during_the_first_third_is_warm_up():
    samples = [(t, 1000 * MIB + min(t, 500) * MIB) for t in range(0, 1800, 15)]
    grown, allowed = rss_growth(samples)
    assert grown <= allowed


def test_small_processes_get_the_absolute_floor():
    assert rss_growth([(0, 100 * MIB), (60, 100 * MIB)])[1] == 32 * MIB
