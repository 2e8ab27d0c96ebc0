"""SLO routing and admission with real processes: colocated workers behind the gateway (each one a
prefill site, a decode site or both for a request), prefix affinity across two prefill workers, a
burst the admission queue must bound, and constrained replies on colocated workers."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from constrained_replies import (
    check_forced_tool_calls,
    check_json_schema_replies,
    check_structural_tags,
    check_structured_output_kinds,
)
from parity_prompts import travel_diary
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS, check_runs, engine_reference
from routing_metrics import increase, placements
from shared_pool import gateway_args
from tandem.v1 import decode_pb2, decode_pb2_grpc

from engine.sampling_params import SamplingParams
from harness.leak_check import assert_no_leaks, load_report
from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker
from services.client import TandemClient
from services.common.convert import sampling_params_to_proto, step_model_from_proto
from services.common.server import channel_options

FLAGS = ["--threads", "1", "--kv-cache-mib", "128", *PINNED_FLAGS]
RPC_TIMEOUT_S = 300.0
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _start(*arg_lists: list[str]) -> list[WorkerProcess]:
    workers = [start_worker(args, wait=False) for args in arg_lists]
    for worker in workers:
        worker.wait_ready()
    return workers


def _stop(workers: list[WorkerProcess]) -> None:
    codes = [worker.stop() for worker in reversed(workers)]
    assert codes == [0] * len(codes), codes


def _tokens(stream) -> tuple[list[int], object]:
    ids, last = [], None
    for chunk in stream:
        ids.extend(chunk.token_ids)
        last = chunk
    return ids, last


@pytest.fixture(scope="module")
def colocated():
    ports = [free_port(), free_port()]
    workers = [["worker", "--role", "colocated", "--port", str(port), *FLAGS] for port in ports]
    # Objectives every request meets: this fixture is about colocated correctness, not admission. A
    # prompt moves to the other worker only where that is predicted four times sooner, so that the
    # two workers' step models, fitted on a machine the other tests share, cannot trade prompts on
    # their noise.
    gateway = ["gateway", "--port", "0", "--http-port", "0", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000",
               "--split-ttft-share", "0.25", "--colocated", ",".join(f"127.0.0.1:{port}" for port in ports)]
    started = _start(*workers, gateway)
    yield started
    _stop(started)


def test_colocated_workers_behind_the_gateway_match_the_engine(colocated, make_engine, tokenizer):
    *workers, gateway = colocated
    diary = tokenizer.encode(travel_diary())
    prompts = [diary[: 20 + 37 * i] for i in range(6)]
    expected = engine_reference(make_engine(), prompts, [SamplingParams(**GREEDY)] * len(prompts))
    before = [load_report(worker).finished_requests for worker in workers]
    with TandemClient(str(gateway.address)) as client, ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _tokens(client.generate(token_ids=p, **GREEDY, timeout=RPC_TIMEOUT_S))[0],
                            prompts))
    check_runs(got, expected, "colocated workers")  # the engine batches them differently
    after = [load_report(worker).finished_requests for worker in workers]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def _placements(gateway: WorkerProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{gateway.http_address}/metrics", timeout=30) as reply:
        return placements(text_string_to_metric_families(reply.read().decode()))


def _decode_directly(worker: WorkerProcess, prompt: list[int], prefill_address: str = "") -> list:
    """Decode.Generate on `worker`, the prompt computed by the worker at `prefill_address` ("": itself)."""
    request = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling=sampling_params_to_proto(
        SamplingParams(**GREEDY)), prefill_address=prefill_address)
    with grpc.insecure_channel(str(worker.address), options=channel_options()) as channel:
        return list(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=RPC_TIMEOUT_S))


def test_constrained_replies_and_tool_calls_on_colocated_workers(colocated):
    """Each constraint kind and forced tool calls on colocated workers, where one worker samples
    every token under the grammar (prompts split between them: the disaggregated modules)."""
    client = openai.OpenAI(base_url=f"http://{colocated[-1].http_address}/v1", api_key="unused", max_retries=0,
                           timeout=RPC_TIMEOUT_S)
    model = client.models.list().data[0].id
    check_json_schema_replies(client, model)
    check_structured_output_kinds(client, model)
    check_structural_tags(client, model)
    check_forced_tool_calls(client, model)
    assert_no_leaks(colocated[:2])


def test_a_colocated_worker_computes_a_prompt_that_another_decodes(colocated, make_engine, tokenizer):
    # A computes the diary's prompt for B while it decodes a request of its own; B decodes it.
    site_a, site_b, _ = colocated
    diary = tokenizer.encode(f"Flexible roles.\n{travel_diary()}")[:600]
    own = diary[:40]
    expected = engine_reference(make_engine(), [diary, own], [SamplingParams(**GREEDY)] * 2)
    with ThreadPoolExecutor(1) as beside:
        own_run = beside.submit(_decode_directly, site_a, own)
        chunks = _decode_directly(site_b, diary, prefill_address=str(site_a.address))
        own_chunks = own_run.result()
    check_runs([[t for c in chunks for t in c.token_ids], [t for c in own_chunks for t in c.token_ids]], expected,
               "A's prompt decoded on B, and A's own request")
    timings = chunks[-1].timings  # B reserved the prompt's blocks, and A's pages filled them
    assert timings.reserve_s > 0 and timings.prefill_compute_s > 0
    assert_no_leaks(colocated[:2])


def test_the_gateway_places_a_request_on_one_colocated_worker_or_two(colocated, make_engine, tokenizer):
    # While X streams a request whose prompt it computed (aggregated), a request sharing that long
    # prompt is cheaper computed by X, which holds its prefix, and decoded by the idle Y (disaggregated).
    *workers, gateway = colocated
    shared = tokenizer.encode(f"Placement test.\n{travel_diary()}")[:900]
    second = shared + tokenizer.encode(" Where did they go next?")
    expected = engine_reference(make_engine(), [second], [SamplingParams(**GREEDY)])
    before = _placements(gateway)
    with TandemClient(str(gateway.address)) as client:
        first = client.generate(token_ids=shared, **{**GREEDY, "max_tokens": 32}, timeout=RPC_TIMEOUT_S)
        next(first)  # streaming: the gateway counts it on its worker until the stream ends
        got, _ = _tokens(client.generate(token_ids=second, **GREEDY, timeout=RPC_TIMEOUT_S))
        _tokens(first)
    check_runs([got], expected, "a prompt computed on one worker and decoded on the other")
    placed = increase(before, _placements(gateway))
    assert placed == {"aggregated": 1, "disaggregated": 1}, (placed, gateway.log_tail(6))
    assert_no_leaks(workers)


def test_requests_sharing_a_system_prompt_go_to_the_prefill_worker_holding_it(pool, tokenizer):
    # The shared workers' two prefill workers and a decode worker; objectives the prefill workers meet
    # with room to spare: the decode worker never takes a prompt.
    prefills = pool.prefill
    [gateway] = _start(gateway_args([w.args for w in prefills], [pool.decode[0].args], "--ttft-slo-ms", "600000"))
    started = [gateway]
    try:
        # A first line of its own, so that no other module's requests left this prefix in a prefill
        # worker's cache.
        system = tokenizer.encode(f"Routing test.\n{travel_diary()}")[:320]  # 20 full blocks
        before = [load_report(worker).finished_requests for worker in prefills]
        cached = []
        with TandemClient(str(gateway.address)) as client:
            for question in range(5):
                prompt = system + tokenizer.encode(f" Question {question}: where did they go next?")
                _, last = _tokens(client.generate(token_ids=prompt, **GREEDY, timeout=RPC_TIMEOUT_S))
                cached.append(last.usage.cached_tokens)
        served = [load_report(worker).finished_requests - b for worker, b in zip(prefills, before, strict=True)]
        assert sorted(served) == [0, 5], served  # every request went where the prefix was
        assert cached[0] < 320 <= min(cached[1:]), cached
    finally:
        _stop(started)


def test_a_burst_beyond_capacity_is_bounded_refused_with_retry_after_and_then_served(tokenizer):
    worker_args = ["worker", "--role", "colocated", "--port", str(free_port()), *FLAGS]
    gateway_args = ["gateway", "--port", "0", "--http-port", "0", "--colocated", f"127.0.0.1:{worker_args[4]}",
                    "--max-queued-requests", "2"]
    started = _start(worker_args, gateway_args)
    try:
        worker, gateway = started
        diary = tokenizer.encode(travel_diary())
        prompts = [diary[i:i + 400] for i in range(0, 12 * 7, 7)]  # 12 distinct 400-token prompts
        # Objectives this worker meets for one such request alone but not for several queued behind
        # each other: its measured prefill time for the prompt, with 60% to spare.
        prefill_s = step_model_from_proto(load_report(worker).step_model).prefill_s(400, 2048)
        slo = {"ttft_ms": max(1, int(1600 * prefill_s)), "tpot_ms": 60_000}

        def run(prompt: list[int]) -> tuple[str, object]:
            with TandemClient(str(gateway.address)) as client:
                stream = client.generate(token_ids=prompt, **GREEDY, **slo, timeout=RPC_TIMEOUT_S)
                try:
                    ids, _ = _tokens(stream)
                except grpc.RpcError as error:
                    trailers = dict(error.trailing_metadata() or ())
                    return error.code().name, trailers.get("retry-after")
                return "OK", len(ids)

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, prompts))
        outcomes = [code for code, _ in results]
        assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, results
        assert outcomes.count("OK") >= 1 and outcomes.count("RESOURCE_EXHAUSTED") >= 1, results
        assert all(detail == GREEDY["max_tokens"] for code, detail in results if code == "OK"), results
        assert all(int(detail) >= 1 for code, detail in results if code == "RESOURCE_EXHAUSTED"), results
        # The burst is over: the next request is served, and nothing stays held.
        assert run(prompts[0]) == ("OK", GREEDY["max_tokens"])
        assert_no_leaks([worker])
    finally:
        _stop(started)
