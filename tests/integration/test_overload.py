"""Overload through both client APIs: a burst at ten times what a disaggregated mesh (a prefill and a
decode worker process behind a gateway) can hold within the requests' objectives. The admission queue
stays bounded, the rest is refused with RESOURCE_EXHAUSTED / HTTP 429 and a retry-after hint, the
gateway's memory stays bounded, every admitted request completes, and afterwards the mesh serves
normally and holds nothing. (tests/integration/test_routing.py bounds a smaller gRPC burst on a
colocated worker; whether admitted requests keep their objectives is measured by `python -m bench overload`.)"""

from __future__ import annotations

import pytest
from shared_pool import Pool, start_gateway

from harness.burst import burst_requests, objectives
from harness.leak_check import assert_no_leaks
from harness.load_clients import OK, REFUSED, LoadRunner
from harness.mesh import Mesh
from harness.process_memory import RssSampler

MAX_QUEUED = 4
PROMPT_TOKENS = 256
MAX_TOKENS = 4
TTFT_FACTOR = 3.0  # the TTFT objective holds about three prompts' prefill
# What the gateway can hold at once without refusing: the prompts whose prefill fits in the TTFT
# objective, and the queue.
CAPACITY = int(TTFT_FACTOR) + MAX_QUEUED
BURST = 10 * CAPACITY
# Generous: a gateway that kept every refused request's state would still fit, but not one whose
# queue or buffers grew with the load.
RSS_GROWTH_BOUND = 128 << 20


@pytest.fixture(scope="module")
def mesh(pool: Pool):
    # One prefill and one decode worker of the shared ones: the objectives come from their own step
    # models, so their formats do not matter; the other two serve nothing meanwhile.
    prefill, decode = pool.prefill[:1], pool.decode[:1]
    gateway = start_gateway(prefill, decode, "--max-queued-requests", str(MAX_QUEUED))
    yield Mesh(prefill, decode, gateway)
    assert gateway.stop() == 0, gateway.log_tail()


def test_a_burst_at_ten_times_capacity_is_bounded_refused_and_then_served(mesh):
    slo = objectives(mesh, PROMPT_TOKENS, MAX_TOKENS, ttft_factor=TTFT_FACTOR)
    sampler = RssSampler({"gateway": mesh.gateway.proc.pid}, interval_s=0.05)
    with LoadRunner(str(mesh.gateway.address), str(mesh.gateway.http_address)) as runner:
        sampler.start()
        outcomes = runner.run_all(burst_requests(BURST, PROMPT_TOKENS, MAX_TOKENS, slo, seed=1), concurrency=BURST)
        sampler.stop()
        summary = f"{slo}: " + ", ".join(f"{o.request.api} {o.status} {o.tokens} {o.detail[:80]}" for o in outcomes)
        assert {o.status for o in outcomes} <= {OK, REFUSED}, summary
        assert OK in {o.status for o in outcomes}, summary
        # Both APIs refuse (RESOURCE_EXHAUSTED, HTTP 429); which API's requests the admitted ones are
        # is a race, and both serve below.
        assert {o.request.api for o in outcomes if o.status == REFUSED} == {"grpc", "http"}, summary
        assert all(o.tokens == MAX_TOKENS for o in outcomes if o.status == OK), summary
        assert all(o.retry_after_s is not None and o.retry_after_s >= 1 for o in outcomes if o.status == REFUSED), \
            summary
        growth = sampler.peak("gateway") - sampler.samples[0][1]["gateway"]
        assert growth < RSS_GROWTH_BOUND, f"the gateway grew by {growth >> 20} MiB during the burst"

        # The burst is over: requests with the same objectives are served, one through each API.
        after = [runner.run(request) for request in burst_requests(2, PROMPT_TOKENS, MAX_TOKENS, slo, seed=2)]
        assert [(o.status, o.tokens) for o in after] == [(OK, MAX_TOKENS)] * 2, after
    assert_no_leaks(mesh.workers)
