"""Calls on prefill and decode worker processes that the multi-process layouts' mesh tests share:
a worker's load report, a disaggregated request, polls for freed blocks, and killing one of a
worker's other ranks while a prompt moves."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import grpc
from reference import check_against
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

from engine.sampling_params import SamplingParams
from harness.worker import WorkerProcess, running, start_worker
from services.common.convert import sampling_params_to_proto
from services.common.server import channel_options

DEADLINE_S = 120.0  # generous bound for the polls below; no test asserts elapsed time
# A prompt's expected greedy tokens and their top-2 margins, computed by the one-process engine.
Expected = Callable[[list[int]], tuple[list[int], list[float]]]


@contextlib.contextmanager
def workers_running(arg_lists: dict[str, list[str]]) -> Iterator[dict[str, WorkerProcess]]:
    """The workers of `arg_lists` by name, started together so that their loads overlap; each must
    exit 0 when stopped."""
    started = {name: start_worker(args, wait=False) for name, args in arg_lists.items()}
    try:
        for worker in started.values():
            worker.wait_ready()
        yield started
    finally:
        codes = {name: (worker.stop(), worker.log_tail()) for name, worker in started.items()}
    assert all(code == 0 for code, _ in codes.values()), codes


def load_report(worker: WorkerProcess) -> common_pb2.LoadReport:
    stub_type = decode_pb2_grpc.DecodeStub if worker.args[0] == "decode" else prefill_pb2_grpc.PrefillStub
    with grpc.insecure_channel(worker.address, options=channel_options()) as channel:
        return stub_type(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=30)


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def prefill_began(prefill: WorkerProcess) -> Callable[[], bool]:
    """A condition to poll, made before a request is sent: whether `prefill` has begun it. A small
    model computes a prompt in a fraction of a second, which can fall between two polls of
    `running_requests`, so a request that is already finished counts as begun."""
    finished = load_report(prefill).finished_requests

    def began() -> bool:
        report = load_report(prefill)
        return report.running_requests > 0 or report.finished_requests > finished

    return began


def no_blocks_used(*workers: WorkerProcess) -> None:
    until(lambda: not any(load_report(w).used_kv_blocks for w in workers), "blocks still held")


def decode_call(decode: WorkerProcess, prefill: WorkerProcess, prompt: list[int], params: SamplingParams):
    """A disaggregated request: `decode` has `prefill` compute the prompt; the response stream."""
    channel = grpc.insecure_channel(decode.address, options=channel_options())
    request = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling=sampling_params_to_proto(params),
                                       prefill_address=prefill.address)
    return decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=300)


def kill_a_rank_mid_transfer(victim: WorkerProcess, prefill: WorkerProcess, decode: WorkerProcess, prompt: list[int],
                             params: SamplingParams, failed: set[grpc.StatusCode], expected: Expected) -> None:
    """Kill `victim`'s last other rank while `prefill` computes the prompt for `decode`: the request
    ends with a status of `failed`, or, where every page had arrived by then, with the expected
    tokens; the victim exits 1 with all its ranks, and the other side holds no block."""
    ranks = victim.tensor_parallel_ranks()
    assert ranks
    began = prefill_began(prefill)
    call = decode_call(decode, prefill, prompt, params)
    until(began, "the prefill never started")
    os.kill(ranks[-1], signal.SIGKILL)
    try:
        tokens = [t for chunk in call for t in chunk.token_ids]
    except grpc.RpcError as error:
        assert error.code() in failed, (error.code(), error.details())
    else:
        ids, margins = expected(prompt)
        check_against([tokens], [ids], [margins], "served despite the killed rank")
    assert victim.proc.wait(DEADLINE_S) == 1, victim.log_tail()
    until(lambda: not any(running(pid) for pid in ranks), "a rank outlived its worker")
    no_blocks_used(decode if victim is prefill else prefill)
