"""SLO routing and admission with real processes: colocated workers behind the gateway (each one a
prefill site, a decode site or both for a request), prefix affinity by the gateway's exact index of the
workers' block events (a conversation's next turn, two prefill workers, tenants' cache salts, a worker
whose hashes disagree), a burst the admission queue must bound, and constrained replies on colocated
workers."""

from __future__ import annotations

import functools
import json
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import openai
import pytest
from constrained_replies import (
    check_forced_tool_calls,
    check_json_schema_replies,
    check_structural_tags,
    check_structured_output_kinds,
)
from exact_index import (
    check_index_agrees,
    health_detail,
    listed_address,
    start_wrong_hashing_peer,
    wait_until_caught_up,
    wait_until_trusted,
)
from parity_prompts import travel_diary
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS, check_runs, engine_reference
from routing_metrics import increase, placements, poll
from shared_pool import NO_SLO, gateway_args, openai_client
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
T = TypeVar("T")
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


def test_a_colocated_worker_counts_the_prefix_hits_of_a_prompt_it_computes_itself(colocated, tokenizer):
    # Its vllm:prefix_cache_hits counted only the hits of prompts other workers computed for it.
    worker, _, gateway = colocated
    prompt = tokenizer.encode(f"Hit counting.\n{travel_diary()}")[:300]

    def hits() -> float:
        return _counters(gateway, "vllm:prefix_cache_hits", metrics_address=str(worker.metrics_address))[()]

    _decode_directly(worker, prompt)
    before = hits()
    cached = _decode_directly(worker, prompt)[-1].usage.cached_tokens
    assert cached >= 256 and hits() - before == cached, (cached, before, hits())


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
        for worker in workers:  # the prompt's blocks, cached before its first token, reach the index
            wait_until_caught_up(gateway, worker)
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
                for worker in prefills:  # a client's next request comes after the worker's events
                    wait_until_caught_up(gateway, worker)
        served = [load_report(worker).finished_requests - b for worker, b in zip(prefills, before, strict=True)]
        assert sorted(served) == [0, 5], served  # every request went where the prefix was
        assert cached[0] < 320 <= min(cached[1:]), cached
    finally:
        _stop(started)


def _counters(gateway: WorkerProcess, name: str, *labels: str, suffix: str = "_total",
              metrics_address: str | None = None) -> dict[tuple[str, ...], float]:
    """The gateway's counter `name` now (or, `suffix` "", a gauge's; or, at its `metrics_address`, a
    worker's), by the values of `labels`."""
    with urllib.request.urlopen(f"http://{metrics_address or gateway.http_address}/metrics", timeout=30) as reply:
        families = text_string_to_metric_families(reply.read().decode())
        return {tuple(sample.labels[label] for label in labels): sample.value for family in families
                if family.name == name for sample in family.samples if sample.name == name + suffix}


def _sites(gateway: WorkerProcess, run: Callable[[], T]) -> tuple[T, set[str], set[str]]:
    """Run `run()` through the gateway: (its result, the workers that computed its prompt, those that
    decoded it)."""
    before = _counters(gateway, "tandem:routing_decisions", "pool", "worker")
    result = run()
    routed = increase(before, _counters(gateway, "tandem:routing_decisions", "pool", "worker"))  # type: ignore[arg-type]
    decode = {worker for pool, worker in routed if pool == "decode"}
    prefill = {worker for pool, worker in routed if pool == "prefill" and worker != "local"}
    return result, prefill or decode, decode


def test_a_conversations_next_turn_goes_to_the_worker_holding_its_first_turn(colocated):
    # Each conversation's first turn lands on either worker (turn order, by load); its second turn
    # extends it, and goes where the gateway's exact index says the first turn's blocks are.
    *workers, gateway = colocated
    client = openai_client(gateway, RPC_TIMEOUT_S)
    model = client.models.list().data[0].id
    chat = functools.partial(client.chat.completions.create, model=model, max_tokens=8, temperature=0)
    wait_until_trusted(gateway, workers)
    hits_before = _counters(gateway, "tandem:prefix_hit_tokens", "tier")
    expected_hits = 0
    for topic in ("canals", "mountains", "markets"):
        messages = [{"role": "system", "content": f"A conversation about {topic}.\n{travel_diary()[:1200]}"},
                    {"role": "user", "content": "Where did they go first?"}]
        first, computed, decoded = _sites(gateway, functools.partial(chat, messages=list(messages)))
        holders = computed | decoded  # the prompt's blocks are cached where it was computed and decoded
        for worker in workers:
            wait_until_caught_up(gateway, worker)  # as a person's reply would come after them
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And where next?"}]
        second, computed, _ = _sites(gateway, functools.partial(chat, messages=messages))
        assert computed <= holders, (topic, computed, holders)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens // 16 * 16 - 16, (topic, cached, first.usage.prompt_tokens)
        expected_hits += cached
    hits = increase(hits_before, _counters(gateway, "tandem:prefix_hit_tokens", "tier"))  # type: ignore[arg-type]
    assert hits.get(("device",), 0) >= expected_hits, hits  # the router counted the prefixes it routed by
    check_index_agrees(gateway, workers)  # idle now: the index holds what their prefix caches hold
    assert_no_leaks(workers)


def test_the_approximate_index_sends_a_conversations_next_turn_where_it_placed_the_first(colocated):
    # A second gateway over the same workers, routing by where it placed prompts (no block events):
    # the second turn goes where the first was computed or decoded, without waiting for any event.
    *workers, _ = colocated
    [gateway] = _start(["gateway", "--port", "0", "--http-port", "0", "--ttft-slo-ms", "600000",
                        "--tpot-slo-ms", "600000", "--split-ttft-share", "0.25", "--prefix-index", "approximate",
                        "--colocated", ",".join(listed_address(worker) for worker in workers)])
    try:
        with urllib.request.urlopen(f"http://{gateway.http_address}/health", timeout=30) as reply:
            body = json.load(reply)
        assert body["prefix_index"] == "approximate", body
        assert {worker["prefix_index"] for worker in body["workers"]} == {"approximate"}, body
        info = _counters(gateway, "tandem:prefix_index_info", "index", suffix="")
        assert info == {("approximate",): 1.0}, info
        client = openai_client(gateway, RPC_TIMEOUT_S)
        chat = functools.partial(client.chat.completions.create, model=client.models.list().data[0].id, max_tokens=8,
                                 temperature=0)
        for topic in ("rivers", "islands"):
            messages = [{"role": "system", "content": f"Approximate routing, {topic}.\n{travel_diary()[:1200]}"},
                        {"role": "user", "content": "Where did they go first?"}]
            first, computed, decoded = _sites(gateway, functools.partial(chat, messages=list(messages)))
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And where next?"}]
            second, computed_next, _ = _sites(gateway, functools.partial(chat, messages=messages))
            assert computed_next <= computed | decoded, (topic, computed_next, computed, decoded)
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached >= first.usage.prompt_tokens // 16 * 16 - 16, (topic, cached, first.usage.prompt_tokens)
        assert_no_leaks(workers)
    finally:
        _stop([gateway])



def _decode_salted(worker: WorkerProcess, prompt: list[int], cache_salt: str) -> int:
    """Decode.Generate on `worker` with `cache_salt` (the gRPC API's field); its cached prompt tokens."""
    sampling = sampling_params_to_proto(SamplingParams(**GREEDY, cache_salt=cache_salt))
    with grpc.insecure_channel(str(worker.address), options=channel_options()) as channel:
        chunks = list(decode_pb2_grpc.DecodeStub(channel).Generate(
            decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling=sampling), timeout=RPC_TIMEOUT_S))
    return chunks[-1].usage.cached_tokens


def test_a_cache_salt_keeps_two_tenants_prefixes_apart(colocated, tokenizer):
    *workers, gateway = colocated
    client = openai_client(gateway, RPC_TIMEOUT_S)
    model = client.models.list().data[0].id
    prompt = f"Tenant test.\n{travel_diary()[:1200]}"

    def cached(salt: str | None) -> int:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"cache_salt": salt} if salt is not None else None)
        for worker in workers:
            wait_until_caught_up(gateway, worker)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 16  # the gateway hashed the salt as the engine did: found its blocks
    assert cached("tenant-b") == 0
    assert cached(None) == 0  # no salt is a tenant of its own
    # On the worker holding tenant a's blocks, the engine itself keeps them from b (the gRPC API's field).
    ids = tokenizer.encode(f"Tenant engine test.\n{travel_diary()[:1200]}")
    assert _decode_salted(workers[0], ids, "tenant-a") == 0
    assert _decode_salted(workers[0], ids, "tenant-a") >= 16
    assert _decode_salted(workers[0], ids, "tenant-b") == 0
    for bad in ("", 7):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            client.completions.create(model=model, prompt="Hello", max_tokens=1, extra_body={"cache_salt": bad})
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1,
                                           extra_body={"cache_salt": bad})
    assert_no_leaks(workers)


def test_a_worker_hashing_blocks_differently_is_refused_loudly_and_still_routed_by_load(colocated):
    # The peer is the misbehaving worker: its load reports' probe hashes are not the probe text's.
    real = colocated[0]
    peer, peer_address = start_wrong_hashing_peer(load_report(real).model_name)
    try:
        [gateway] = _start(["gateway", "--port", "0", "--http-port", "0", *NO_SLO,
                            "--colocated", f"{listed_address(real)},{peer_address}"])
        try:
            poll(lambda: health_detail(gateway)[listed_address(real)]["prefix_index"] == "exact",
                 "the real worker's hashes accepted", 60.0)
            detail = health_detail(gateway)[peer_address]
            assert detail["prefix_index"].startswith("refused: probe block 0 differs"), detail
            assert detail["routable"]  # routed by its load, as holding nothing
            with urllib.request.urlopen(f"http://{gateway.http_address}/metrics", timeout=30) as reply:
                families = {family.name: family for family in text_string_to_metric_families(reply.read().decode())}
            refused = {s.labels["worker"]: s.value for s in families["tandem:prefix_refused_workers"].samples}
            assert refused == {peer_address: 1.0}
            assert [s.value for s in families["tandem:prefix_probe_mismatches"].samples if s.name.endswith("_total")] \
                == [1.0]
            assert f"worker {peer_address}: its KV block hashes disagree" in gateway.log_tail(400)
        finally:
            _stop([gateway])
    finally:
        peer.stop(None)


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
