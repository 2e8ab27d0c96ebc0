"""The goodput suite's client against bench/harness/sse_stub.py on loopback: SSE timing, token counts and
failures as the benchmark records them (the stub stands in for a model server, so no model loads)."""

from __future__ import annotations

import asyncio

import pytest

from bench.harness.sse_client import request_body, run_open_loop, served_model
from bench.harness.sse_stub import MODEL, StubServer
from bench.harness.workload import BenchRequest


@pytest.fixture
def stub():
    server = StubServer(prefill_s=0.2, tpot_s=0.02).start()
    yield server
    server.stop()


def test_streamed_requests_are_timed_by_their_chunks(stub: StubServer):
    assert asyncio.run(served_model(stub.url)) == MODEL
    bodies = [request_body(MODEL, BenchRequest("hello", 1, tokens), (2000.0, 100.0)) for tokens in (5, 12)]
    assert bodies[0]["ttft_ms"] == 2000 and bodies[0]["ignore_eos"] and bodies[0]["stream"]
    results = asyncio.run(run_open_loop(stub.url, bodies, [0.0, 0.0], request_timeout_s=60.0))
    assert [r.output_tokens for r in results] == [5, 12]
    assert all(r.ok for r in results)
    # Both arrive together and share one prefill lane: one waits for the other's 0.2 s.
    assert min(r.ttft_s for r in results) >= 0.2
    assert max(r.ttft_s for r in results) >= 0.4
    # Not >= 0.02: a first chunk read late (a busy machine) shortens the measured span.
    assert all(r.tpot_s > 0 for r in results)
    assert all(r.finished_s > r.started_s for r in results)


def test_rejected_and_unfinished_requests_count_as_failures(stub: StubServer):
    not_streamed = {**request_body(MODEL, BenchRequest("hello", 1, 5), None), "stream": False}
    slow = request_body(MODEL, BenchRequest("hello", 1, 200), None)  # 200 × 20 ms cannot finish in 1 s
    rejected, timed_out = asyncio.run(run_open_loop(stub.url, [not_streamed, slow], [0.0, 0.0], request_timeout_s=1.0))
    assert not rejected.ok and rejected.error == "HTTP 400"
    assert not timed_out.ok and timed_out.error == "timeout"
