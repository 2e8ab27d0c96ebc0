"""The benchmarks' SSE client (bench/common/sse_client.py) against the stub server
(bench/common/sse_stub.py) on loopback: SSE timing, token counts and failures as the goodput suite
records them (the stub stands in for a model server, so no model loads)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bench.common.sse_client import request_body, run_open_loop, served_model
from bench.common.sse_stub import MODEL, StubServer
from bench.common.workload import BenchRequest

PREFILL_S = 0.2
TPOT_S = 0.02


class LockstepClock:
    """A fake clock that the stub server moves forward instead of sleeping. A move waits until the
    client has read the time since the previous one, so that the client reads each chunk's time
    before the next chunk is due: every reading is exact, however busy the machine."""

    def __init__(self) -> None:
        self._now = 0.0
        self._read = True
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self._read = True
            self._changed.notify_all()
            return self._now

    def advance(self, seconds: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._read, timeout=30.0):
                raise TimeoutError("the client never read the time of the last chunk")
            self._now += seconds
            self._read = False


@pytest.fixture
def stub():
    server = StubServer(prefill_s=PREFILL_S, tpot_s=TPOT_S).start()
    yield server
    server.stop()


def test_a_streamed_request_is_timed_by_its_text_chunks():
    clock = LockstepClock()
    server = StubServer(prefill_s=PREFILL_S, tpot_s=TPOT_S, pause=clock.advance).start()
    try:
        body = request_body(MODEL, BenchRequest("hello", 1, 12), None)
        [result] = asyncio.run(run_open_loop(server.url, [body], [0.0], request_timeout_s=60.0, clock=clock))
    finally:
        server.stop()
    assert result.ok and result.output_tokens == 12
    # The first chunk comes after the prefill, then one chunk every TPOT_S: TTFT is to the first
    # text chunk, TPOT the span of the text chunks over the 11 gaps between 12 tokens.
    assert result.ttft_s == pytest.approx(PREFILL_S)
    assert result.tpot_s == pytest.approx(TPOT_S)
    assert result.started_s == 0.0
    assert result.finished_s == pytest.approx(PREFILL_S + 11 * TPOT_S)


def test_streamed_requests_get_their_token_counts(stub: StubServer):
    assert asyncio.run(served_model(stub.url)) == MODEL
    bodies = [request_body(MODEL, BenchRequest("hello", 1, tokens), (2000.0, 100.0)) for tokens in (5, 12)]
    assert bodies[0]["ttft_ms"] == 2000 and bodies[0]["ignore_eos"] and bodies[0]["stream"]
    results = asyncio.run(run_open_loop(stub.url, bodies, [0.0, 0.0], request_timeout_s=60.0))
    assert [r.output_tokens for r in results] == [5, 12]
    assert all(r.ok for r in results)
    assert all(r.finished_s > r.started_s for r in results)


def test_rejected_and_unfinished_requests_count_as_failures(stub: StubServer):
    not_streamed = {**request_body(MODEL, BenchRequest("hello", 1, 5), None), "stream": False}
    slow = request_body(MODEL, BenchRequest("hello", 1, 200), None)  # 200 × 20 ms cannot finish in 1 s
    rejected, timed_out = asyncio.run(run_open_loop(stub.url, [not_streamed, slow], [0.0, 0.0], request_timeout_s=1.0))
    assert not rejected.ok and rejected.error == "HTTP 400"
    assert not timed_out.ok and timed_out.error == "timeout"
