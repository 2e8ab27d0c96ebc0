"""The soak suite's flat-memory rule (RSS fitted over the last two thirds of the run, against
max(32 MiB, 5% of the median RSS there)) and its open-loop load."""

from __future__ import annotations

import itertools
import time

import pytest

from bench.suites.soak import Load, rss_growth

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


class _Recorder:
    """Stands in for the mesh's LoadRunner: the open-loop arrivals, not a server, are under test."""

    def __init__(self) -> None:
        self.sent: list[float] = []

    def run(self, request: object) -> str:
        self.sent.append(time.monotonic())
        time.sleep(0.05)  # requests overlap: an open loop does not wait for the previous one
        return "ok"


def test_open_loop_load_sends_at_the_poisson_rate_whatever_runs():
    recorder = _Recorder()
    load = Load(recorder, itertools.repeat(None), concurrency=1, rate=200.0, seed=3)  # type: ignore[arg-type]
    time.sleep(1.0)
    load.stop()
    assert 120 <= len(recorder.sent) <= 280  # 200 expected; a closed loop of one would send about 20
    assert len(load.outcomes) == len(recorder.sent)  # every request sent ended before stop() returned
