"""A colocated worker at --tensor-parallel-size 3 as real processes (the worker and its two other
ranks, gloo): greedy output through its gRPC face equal to the one-process engine's, and a rank
killed mid-service taking the whole worker down (an error to the request, exit code 1, no rank left)
rather than hanging."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest
from parity_prompts import parity_prompt_ids
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS, check_against
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from engine.offline import generate
from engine.sampling_params import SamplingParams
from harness.worker import WorkerProcess, running, start_worker
from services.common.convert import sampling_params_to_proto
from services.common.server import channel_options

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
DEADLINE_S = 60.0  # generous bound for the polls below; no test asserts elapsed time


@pytest.fixture(scope="module")
def worker():
    worker = start_worker(["worker", "--role", "colocated", "--port", "0", "--threads", "1", "--kv-cache-mib", "64",
                           *PINNED_FLAGS, "--tensor-parallel-size", "3"])
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = parity_prompt_ids(tokenizer)
    return [ids[0], ids[4]]


def _generate(worker: WorkerProcess, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    with grpc.insecure_channel(worker.address, options=channel_options()) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        request = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling=sampling_params_to_proto(params))
        return [t for chunk in stub.Generate(request, timeout=120) for t in chunk.token_ids]


def test_greedy_tokens_equal_the_one_process_engine(worker, prompts, make_engine):
    reference = generate(make_engine(), prompts, replace(GREEDY, logprobs=2))
    margins = [[top[0][1] - top[1][1] for top in (lp.top for lp in c.logprobs)] for c in reference]
    ours = [_generate(worker, prompt) for prompt in prompts]
    check_against(ours, [c.token_ids for c in reference], margins, "colocated worker at TP 3")
    assert len(worker.tensor_parallel_ranks()) == 2


def test_the_load_report_and_the_metrics_say_the_size(worker):
    with grpc.insecure_channel(worker.address, options=channel_options()) as channel:
        report = decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=30)
    assert report.tensor_parallel_size == 3
    with urllib.request.urlopen(f"http://{worker.metrics_address}/metrics", timeout=30) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    assert [sample.value for sample in families["tandem:tensor_parallel_size"].samples] == [3]


def test_a_killed_rank_takes_the_worker_down_with_its_other_ranks(worker, prompts):
    ranks = worker.tensor_parallel_ranks()
    os.kill(ranks[-1], signal.SIGKILL)
    with pytest.raises(grpc.RpcError):
        _generate(worker, prompts[0])
    assert worker.proc.wait(DEADLINE_S) == 1, worker.log_tail()
    assert re.search(r"tensor-parallel rank [12] exited with code -9", worker.log_tail(200))
    deadline = time.monotonic() + DEADLINE_S
    while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in ranks)

