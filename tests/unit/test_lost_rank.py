"""Rank 0 names the follower that failed, not one that stopped cleanly in its wake: a killed rank
breaks its peers' collectives, and a peer may exit (code 0) before rank 0 looks."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from engine.parallel.group import TensorParallelGroup


@dataclass
class _Follower:
    exitcode: int | None  # None: running

    def is_alive(self) -> bool:
        return self.exitcode is None


def _lost(*codes: int | None) -> str | None:
    return TensorParallelGroup.lost_rank(SimpleNamespace(followers=[_Follower(code) for code in codes]))


def test_the_killed_rank_is_named_even_when_an_earlier_rank_stopped_in_its_wake():
    assert _lost(0, -9) == "tensor-parallel rank 2 exited with code -9"


def test_a_rank_that_alone_stopped_is_named_whatever_its_code():
    assert _lost(None, 0) == "tensor-parallel rank 2 exited with code 0"
    assert _lost(1, None) == "tensor-parallel rank 1 exited with code 1"


def test_nothing_is_lost_while_every_rank_runs():
    assert _lost(None, None) is None
