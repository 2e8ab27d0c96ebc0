"""Two colocated workers as real processes, each able to take any part of a request: one computes a
prompt for the other while it decodes a request of its own, and the other decodes it; greedy output
equals the aggregated run's, and neither worker holds a block afterwards."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from parity_prompts import parity_prompt_ids
from reference import PINNED_FLAGS
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from engine.sampling_params import SamplingParams
from harness.leak_check import assert_no_leaks
from harness.worker import WorkerProcess, start_worker
from services.common.convert import sampling_params_to_proto
from services.common.server import channel_options

FLAGS = ["--port", "0", "--threads", "1", "--kv-cache-mib", "64", *PINNED_FLAGS]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def sites() -> Iterator[list[WorkerProcess]]:
    """Two colocated workers (the worker command's default role), started together."""
    started = [start_worker(["worker", *FLAGS], wait=False) for _ in range(2)]
    try:
        for worker in started:
            worker.wait_ready()
        yield started
        assert_no_leaks(started)
    finally:
        codes = [(worker.stop(), worker.log_tail()) for worker in started]
    assert all(code == 0 for code, _ in codes), codes


def _chunks(worker: WorkerProcess, prompt: list[int], prefill_address: str = "") -> list[common_pb2.TokenChunk]:
    with grpc.insecure_channel(worker.address, options=channel_options()) as channel:
        return list(decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.DecodeRequest(
            prompt_token_ids=prompt, sampling=sampling_params_to_proto(GREEDY), prefill_address=prefill_address),
            timeout=120))


def _generate(worker: WorkerProcess, prompt: list[int]) -> list[int]:
    return [token for chunk in _chunks(worker, prompt) for token in chunk.token_ids]


def test_a_colocated_worker_computes_a_prompt_that_another_decodes(sites, tokenizer):
    site_a, site_b = sites
    prompts = parity_prompt_ids(tokenizer)
    handed, own = prompts[3], prompts[0]  # the ~1,000-token diary goes from A to B
    aggregated = _generate(site_b, handed)
    own_aggregated = _generate(site_a, own)
    # A decodes a request of its own while it computes the diary's prompt for B.
    own_tokens: list[int] = []
    beside = threading.Thread(target=lambda: own_tokens.extend(_generate(site_a, own)))
    beside.start()
    chunks = _chunks(site_b, handed, prefill_address=site_a.address)
    beside.join()
    assert [token for chunk in chunks for token in chunk.token_ids] == aggregated
    timings = chunks[-1].timings  # B reserved the prompt's blocks and A's pages filled them
    assert timings.reserve_s > 0 and timings.prefill_compute_s > 0 and timings.kv_wait_s >= 0
    assert own_tokens == own_aggregated
    assert_no_leaks(sites)
