"""The scheduler on its own (no model, no torch): budgets, chunking, preemption, aborts, roles."""

from __future__ import annotations

import sys

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache.manager import KVCacheManager
from engine.kv_connector.policy import KVConnectorPolicy
from engine.kv_connector.scheduler_side import KVConnectorScheduler
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BLOCK = 4


def _req(rid: str, n: int, max_tokens: int = 8, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True), 1024)


def _sched(num_blocks: int = 64, budget: int = 32, chunked: bool = True, max_seqs: int = 8,
           prompt_batch: int | None = None, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                             max_prompt_batch_tokens=prompt_batch)
    return Scheduler(config, kv, **kw)


def _run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {c.request.request_id: [token] for c in out.chunks if c.samples}
    return out, s.update(out, sampled)


def _layout(out) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_scheduler_imports_no_torch():
    assert "engine.scheduler" in sys.modules
    import subprocess

    code = "import sys, engine.scheduler, engine.kv_cache.manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_token_budget_chunks_the_last_prefill():
    s = _sched(budget=32)
    for rid, n in (("a", 10), ("b", 20), ("c", 30)):
        s.add(_req(rid, n))
    out = s.schedule()
    assert _layout(out) == [("a", 0, 10), ("b", 0, 20), ("c", 0, 2)]
    assert [c.samples for c in out.chunks] == [True, True, False]
    s.update(out, {"a": [1], "b": [1]})
    out = s.schedule()
    # Decodes first (one token each), then the rest of c's prompt within the budget.
    assert _layout(out) == [("a", 10, 1), ("b", 20, 1), ("c", 2, 28)]


def test_a_prompt_batch_limit_keeps_a_second_prompt_from_delaying_the_first():
    s = _sched(budget=64, prompt_batch=16)
    for index, (rid, n) in enumerate((("a", 20), ("b", 10), ("c", 6), ("d", 4))):
        s.add(_req(rid, n, base=100 * index))  # no shared prefix
    # The first prompt of a step always runs, whole within the budget, however long; the next
    # waits, though the token budget would have taken it.
    out, _ = _run_step(s)
    assert _layout(out) == [("a", 0, 20)]
    # Prompts batch only while all of them fit the limit: b and c (16), not d too.
    out, _ = _run_step(s)
    assert _layout(out) == [("a", 20, 1), ("b", 0, 10), ("c", 0, 6)]
    out, _ = _run_step(s)
    assert _layout(out) == [("a", 21, 1), ("b", 10, 1), ("c", 6, 1), ("d", 0, 4)]


def test_without_chunking_a_long_prompt_waits_whole():
    s = _sched(budget=32, chunked=False)
    s.add(_req("a", 10))
    s.add(_req("b", 30))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert s.num_waiting == 1 and s.num_waiting_tokens == 30


def test_max_num_seqs_caps_the_batch():
    s = _sched(max_seqs=2)
    for rid in "abc":
        s.add(_req(rid, 3))
    out = s.schedule()
    assert len(out.chunks) == 2 and s.num_waiting == 1


def test_requests_finish_on_max_tokens_and_free_blocks():
    s = _sched()
    s.add(_req("a", 5, max_tokens=3))
    finished = []
    while s.has_work():
        finished += _run_step(s)[1]
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].finish_reason is FinishReason.LENGTH and finished[0].output_token_ids == [7, 7, 7]
    assert s.kv.usage == 0


def test_eos_and_stop_token_ids_finish_after_min_tokens():
    s = _sched(eos_token_ids=[7])
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=8, min_tokens=2), 1024))
    steps = 0
    while s.has_work():
        _run_step(s, token=7)
        steps += 1
    assert steps == 2  # EOS ignored until min_tokens were generated


def test_preemption_requeues_the_newest_and_recomputes():
    # 6 blocks of 4 tokens: two 8-token prompts fit (4 blocks); decoding soon needs more.
    s = _sched(num_blocks=6, budget=64)
    s.add(_req("old", 8, max_tokens=12))
    s.add(_req("new", 8, max_tokens=12, base=100))
    preempted = []
    done = []
    for _ in range(200):
        if not s.has_work():
            break
        out, finished = _run_step(s)
        preempted += out.preempted
        done += finished
        s.kv.check_invariants()
    assert preempted and preempted[0] == "new"
    assert sorted(r.request_id for r in done) == ["new", "old"]
    assert all(len(r.output_token_ids) == 12 for r in done)
    assert s.total_preemptions == len(preempted) and s.kv.usage == 0


def test_prefix_cache_hit_skips_computed_tokens():
    s = _sched(budget=64)
    s.add(_req("a", 13, max_tokens=1))
    while s.has_work():
        _run_step(s)
    s.add(_req("b", 13, max_tokens=1))
    out = s.schedule()
    [chunk] = out.chunks
    assert chunk.start == 12 and chunk.num_tokens == 1 and chunk.request.num_cached_tokens == 12


def test_abort_in_every_state_frees_blocks():
    s = _sched(budget=16)
    s.add(_req("running", 8))
    s.add(_req("chunking", 20))
    s.add(_req("waiting", 8))
    s.schedule()
    assert {r.status for r in s.requests.values()} == {RequestStatus.RUNNING, RequestStatus.WAITING}
    aborted = s.abort(["running", "chunking", "waiting", "unknown"])
    assert [r.request_id for r in aborted] == ["running", "chunking", "waiting"]
    assert all(r.finish_reason is FinishReason.ABORT for r in aborted)
    assert not s.has_work() and not s.requests and s.kv.usage == 0


def _handing_off(keep_s: float = 60.0) -> KVConnectorScheduler:
    return KVConnectorScheduler(KVConnectorPolicy(decodes=False, keep_s=keep_s))


def test_a_handed_off_request_keeps_its_kv_until_released():
    s = _sched(connector=_handing_off())
    s.add(_req("p", 9, max_tokens=4))
    _run_step(s)
    assert s.requests["p"].finish_reason is FinishReason.HANDOFF and len(s.kv.block_table("p")) == 3
    assert s.expire() == []
    s.release("p")
    assert not s.requests and s.kv.usage == 0


def test_a_handed_off_request_never_released_is_freed_at_its_keep_deadline():
    s = _sched(connector=_handing_off(keep_s=0.0))
    s.add(_req("p", 9, max_tokens=4))
    _run_step(s)
    assert s.requests["p"].is_finished and s.kv.usage > 0 and s.connector.is_due()
    assert s.expire() == ["p"]
    assert not s.requests and s.kv.usage == 0 and s.connector.next_deadline() is None
    s.release("p")  # the worker's late release finds nothing
    assert s.kv.usage == 0


def test_on_a_decoding_engine_only_a_request_marked_for_hand_off_hands_off():
    connector = KVConnectorScheduler()
    s = _sched(connector=connector)
    s.add(_req("exported", 9, max_tokens=4))
    connector.hand_off("exported")
    s.add(_req("local", 9, max_tokens=4, base=100))
    _run_step(s)
    assert s.requests["exported"].finish_reason is FinishReason.HANDOFF and s.kv.block_table("exported")
    assert not s.requests["local"].is_finished
    s.release("exported")
    s.add(_req("exported", 9, max_tokens=4))  # the id comes back, unmarked: it decodes here
    _run_step(s)
    assert not s.requests["exported"].is_finished


def test_decode_role_reserve_then_start():
    s = _sched()
    request = _req("d", 9, max_tokens=4)
    assert s.reserve(request, timeout_s=60.0) is not None
    assert request.status is RequestStatus.WAITING_FOR_KV and len(s.kv.block_table("d")) == 3
    assert s.schedule().is_empty  # nothing runs until the KV has arrived
    s.start_reserved("d", first_token=5)
    assert s.connector.next_deadline() is None  # a started request has no reservation left
    out = s.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(9, 1)]


def test_a_reservation_past_its_deadline_is_aborted_and_its_blocks_freed():
    s = _sched()
    assert s.reserve(_req("d", 9), timeout_s=0.0) is not None
    assert s.expire() == ["d"]
    assert not s.requests and s.kv.usage == 0
    with pytest.raises(TimeoutError, match="deadline"):
        s.start_reserved("d", first_token=5)
    s.abort(["d"])  # the worker's abort, after its own timeout, forgets the deadline too
    with pytest.raises(KeyError):
        s.start_reserved("d", first_token=5)


def test_reservation_refused_when_the_cache_is_full():
    s = _sched(num_blocks=2)
    assert s.reserve(_req("d", 9), timeout_s=60.0) is None
    assert not s.requests and s.kv.usage == 0
