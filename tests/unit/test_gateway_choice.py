"""The gateway's worker choice: health first, then least loaded, round-robin among equals."""

from __future__ import annotations

import pytest

from services.gateway.router import NoWorkerError, WorkerLoad, decode_load, prefill_load, rank


def decode(address: str, requests: int = 0, free: int = 100, serving: bool = True) -> WorkerLoad:
    return WorkerLoad(address, serving, requests=requests, free_kv_blocks=free)


def prefill(address: str, queued: int = 0, serving: bool = True) -> WorkerLoad:
    return WorkerLoad(address, serving, queued_prompt_tokens=queued)


def test_unhealthy_workers_are_skipped_even_when_idle():
    workers = [decode("a", requests=0, serving=False), decode("b", requests=5), decode("c", requests=9)]
    assert rank(workers, decode_load, turn=0) == ["b", "c"]


def test_decode_prefers_fewest_requests_then_most_free_blocks():
    workers = [
        decode("busy", requests=3, free=500),
        decode("full", requests=1, free=10),
        decode("roomy", requests=1, free=90),
    ]
    assert rank(workers, decode_load, turn=0) == ["roomy", "full", "busy"]


def test_prefill_prefers_fewest_queued_prompt_tokens():
    workers = [prefill("a", queued=900), prefill("b", queued=20), prefill("c", queued=300)]
    assert rank(workers, prefill_load, turn=7) == ["b", "c", "a"]


def test_ties_take_turns():
    workers = [prefill("a"), prefill("b"), prefill("c"), prefill("loaded", queued=50)]
    firsts = [rank(workers, prefill_load, turn)[0] for turn in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    # The loaded worker stays last whatever the turn: rotation happens only within a tie.
    assert all(rank(workers, prefill_load, turn)[-1] == "loaded" for turn in range(6))


def test_every_serving_worker_is_ranked_once():
    workers = [decode(str(i), requests=i % 3, free=i) for i in range(9)]
    for turn in range(4):
        assert sorted(rank(workers, decode_load, turn)) == sorted(w.address for w in workers)


@pytest.mark.parametrize("workers", [[], [decode("a", serving=False), decode("b", serving=False)]])
def test_no_serving_worker_is_an_error(workers):
    with pytest.raises(NoWorkerError):
        rank(workers, decode_load, turn=0)
