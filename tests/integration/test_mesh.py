"""The whole mesh as real processes on loopback: a gateway in front of two prefill and two decode
workers, the real model, against an in-process colocated engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from parity_prompts import CHAT, PLAIN, parity_prompt_ids, travel_diary
from prometheus_client.parser import text_string_to_metric_families
from reference import ReferenceRun, check_runs, engine_reference
from shared_pool import POOL_FLAGS, Pool

from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from harness.leak_check import assert_no_leaks, load_report
from harness.mesh import Mesh
from harness.paths import REPO
from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker
from services.client import TandemClient

DEADLINE_S = 60.0  # generous bound for conditions polled below; no test asserts elapsed time
RPC_TIMEOUT_S = 300.0
GREEDY = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}


def _start_all(arg_lists: list[list[str]]) -> list[WorkerProcess]:
    """Start processes together, so their loads overlap, and wait for every ready line."""
    workers = [start_worker(args, wait=False) for args in arg_lists]
    for worker in workers:
        worker.wait_ready()
    return workers


def _worker_args(role: str, *extra: str) -> list[str]:
    # A port known before the start, so that a gateway can be started at the same time.
    return [role, "--port", str(free_port()), *POOL_FLAGS, *extra]


def _gateway_args(prefill: list[list[str]], decode: list[list[str]]) -> list[str]:
    def addresses(arg_lists: list[list[str]]) -> str:
        return ",".join(f"127.0.0.1:{args[args.index('--port') + 1]}" for args in arg_lists)

    # Objectives no request here can miss: these tests are about correctness under concurrency, not
    # admission (tests/integration/test_routing.py covers that), and 2 cores serve few requests in 2 s.
    return ["gateway", "--port", "0", "--http-port", "0", "--prefill", addresses(prefill),
            "--decode", addresses(decode), "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"]


def _stop(workers: list[WorkerProcess]) -> None:
    codes = {worker.args[0]: worker.stop() for worker in workers}
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def mesh(pool: Pool):
    # The shared workers: two prefill, two decode, the second of which speculates, so requests routed
    # to it check that greedy output is the same.
    [gateway] = _start_all([_gateway_args([w.args for w in pool.prefill], [w.args for w in pool.decode])])
    yield Mesh(pool.prefill, pool.decode, gateway)
    _stop([gateway])


@pytest.fixture(scope="module")
def client(mesh):
    with TandemClient(str(mesh.gateway.address)) as client:
        yield client


@pytest.fixture(scope="module")
def reference(make_engine):
    """Greedy runs of prompts together on one in-process colocated engine (tokens and top-2 margins):
    it batches differently from the mesh, so outputs are compared by the near-tie rule (check_runs)."""
    engine = make_engine()

    def run(prompts: list[list[int]], params: list[SamplingParams]) -> list[ReferenceRun]:
        return engine_reference(engine, prompts, params)

    return run


def _token_ids(stream) -> list[int]:
    ids: list[int] = []
    for chunk in stream:
        ids.extend(chunk.token_ids)
    return ids


def _concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def test_gateway_process_never_loads_torch(mesh):
    with open(f"/proc/{mesh.gateway.proc.pid}/maps") as maps:
        mapped = maps.read()
    assert "libtorch" not in mapped and "/torch/" not in mapped


def test_greedy_parity_with_colocated_engine(client, tokenizer, reference):
    prompts = parity_prompt_ids(tokenizer)  # PLAIN encoded, then CHAT rendered and encoded
    expected = reference(prompts, [SamplingParams(**GREEDY)] * len(prompts))
    as_ids = [{"token_ids": p} for p in prompts]
    as_text_and_chat = [{"prompt": t} for t in PLAIN] + [{"messages": m} for m in CHAT]
    got = _concurrently(lambda kw: _token_ids(client.generate(**kw, **GREEDY, timeout=RPC_TIMEOUT_S)),
                        as_ids + as_text_and_chat)
    check_runs(got[: len(prompts)], expected, "token id prompts")
    check_runs(got[len(prompts):], expected, "text and chat prompts")


def test_concurrent_requests_spread_over_workers(mesh, client, tokenizer, reference):
    diary = tokenizer.encode(travel_diary())
    # Mixed prompt lengths (7 to ~500 tokens) and output lengths (3 to 20 tokens).
    prompts = [diary[: 7 + (i * 149) % 500] for i in range(32)]
    params = [SamplingParams(max_tokens=3 + (i * 7) % 18, temperature=0.0, ignore_eos=True) for i in range(32)]
    before = [load_report(worker).finished_requests for worker in mesh.workers]

    def run(i: int) -> list[int]:
        stream = client.generate(token_ids=prompts[i], max_tokens=params[i].max_tokens, temperature=0.0,
                                 ignore_eos=True, timeout=RPC_TIMEOUT_S)
        return _token_ids(stream)

    drafts_before = _verified_drafts(mesh.decode[1])
    got = _concurrently(run, list(range(32)))
    check_runs(got, reference(prompts, params), "concurrent requests")
    after = [load_report(worker).finished_requests for worker in mesh.workers]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert _verified_drafts(mesh.decode[1]) > drafts_before  # the speculating worker did speculate


def _verified_drafts(worker: WorkerProcess) -> float:
    return _metric(worker, "vllm:spec_decode_num_drafts_total")


def _metric(worker: WorkerProcess, name: str) -> float:
    """The sum of a sample's values on a worker's /metrics."""
    with urllib.request.urlopen(f"http://{worker.metrics_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


@pytest.mark.parametrize("read_chunks", [0, 2], ids=["during-prefill", "mid-stream"])
def test_client_cancel_frees_every_worker(mesh, client, tokenizer, read_chunks):
    streams = []
    for i in range(2):  # one per decode worker, as the gateway spreads them
        # A new first line defeats the prefix caches; far more tokens than could be generated by the deadline below.
        # Two diaries (~2,200 tokens) take two prefill steps of 2,048: an abort lands between steps, so a
        # cancel sent during the first keeps the prefill from delivering (one step could not be stopped).
        prompt = f"Run {read_chunks}.{i}\n{travel_diary()}\n{travel_diary()}"
        assert len(tokenizer.encode(prompt)) > SchedulerConfig().max_num_batched_tokens  # the pool's step size
        stream = client.generate(prompt=prompt, max_tokens=4000, temperature=0.0,
                                 ignore_eos=True, timeout=RPC_TIMEOUT_S)
        streams.append(stream)
    delivered = sum(_metric(worker, "vllm:time_to_first_token_seconds_count") for worker in mesh.prefill)
    if not read_chunks:  # cancelled once both wait for their prompts' KV, during their first prefill step
        _until(lambda: sum(_reserved_requests(worker) for worker in mesh.decode) == len(streams))
    for stream in streams:
        for _ in range(read_chunks):
            assert next(stream).finish_reason is None
        stream.cancel()
    assert_no_leaks(mesh.workers)
    if not read_chunks:  # no prefill delivered its pages: both cancels landed mid-prefill
        assert sum(_metric(worker, "vllm:time_to_first_token_seconds_count") for worker in mesh.prefill) == delivered


def _reserved_requests(worker: WorkerProcess) -> int:
    """Requests whose blocks the decode worker reserved and whose prompt's KV has not all arrived: a
    request is there from before its prefill starts until its pages are in. (A prefill worker's own
    load, read between its steps, need not ever show both: each prompt may be computed in one step.)"""
    return load_report(worker).reserved_requests


def _until(condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_resource_exhausted_and_retry_on_another_decode_worker(mesh, tokenizer, reference):
    tiny_args = _worker_args("decode", "--kv-cache-blocks", "4")
    prefill, decode = [worker.args for worker in mesh.prefill], mesh.decode[0].args
    long_prompt = travel_diary()  # ~1,000 tokens: far more than 4 blocks of 16
    started: list[WorkerProcess] = []
    try:
        started += _start_all([tiny_args, _gateway_args(prefill, [tiny_args])])
        # Started once the tiny worker serves, so that its first view of the pool includes it.
        started += _start_all([_gateway_args(prefill, [tiny_args, decode])])
        _, only_tiny, mixed = started
        with TandemClient(str(only_tiny.address)) as client, pytest.raises(grpc.RpcError) as refused:
            _token_ids(client.generate(prompt=long_prompt, **GREEDY, timeout=RPC_TIMEOUT_S))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # A request running on the normal worker makes the idle tiny one the gateway's first choice.
        with TandemClient(str(mixed.address)) as client, client.generate(
            prompt="Once upon a time", max_tokens=400, temperature=0.0, ignore_eos=True, timeout=RPC_TIMEOUT_S
        ) as busy:
            next(busy)
            got = _token_ids(client.generate(prompt=long_prompt, **GREEDY, timeout=RPC_TIMEOUT_S))
        check_runs([got], reference([tokenizer.encode(long_prompt)], [SamplingParams(**GREEDY)]), "retried request")
    finally:
        _stop(started[::-1])


def test_list_models_and_invalid_requests(client):
    [model] = client.list_models()
    assert model.id == "SmolLM2-135M-Instruct" and model.max_model_len == 8192
    bad = [
        ({"prompt": "Hi", "temperature": 500.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"prompt": "Hi", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"token_ids": [1, 2, 10**6]}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
        ({"messages": [{"role": "user", "content": "Hi"}], "model": "gpt-4"}, grpc.StatusCode.NOT_FOUND, "gpt-4"),
    ]
    for kwargs, code, named in bad:
        with pytest.raises(grpc.RpcError) as error:
            list(client.generate(**kwargs, timeout=RPC_TIMEOUT_S))
        assert error.value.code() == code and named in error.value.details(), (kwargs, error.value.details())
    # The served model's name is accepted, and a generated request id is echoed on every chunk.
    chunks = list(client.generate(prompt="Hi", model=model.id, max_tokens=4, timeout=RPC_TIMEOUT_S))
    assert len({chunk.request_id for chunk in chunks}) == 1 and chunks[0].request_id
    assert chunks[-1].finish_reason is not None and chunks[-1].usage.completion_tokens == 4


def test_request_without_prompt_is_invalid(mesh):
    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(str(mesh.gateway.address)) as channel, pytest.raises(grpc.RpcError) as error:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(request_id="x"), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith("prompt")


def _chat(mesh: Mesh, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "chat", "--gateway", str(mesh.gateway.address), "--max-tokens", "12",
         *args],
        cwd=REPO, input=stdin, capture_output=True, text=True, timeout=RPC_TIMEOUT_S,
    )


def test_chat_command_prints_the_answer(mesh, tokenizer, reference):
    message = "Say hello to the world."
    done = _chat(mesh, message)
    assert done.returncode == 0, done.stderr
    [run] = reference([tokenizer.encode_chat([{"role": "user", "content": message}])],
                      [SamplingParams(max_tokens=12, temperature=0.0)])
    ids = run.token_ids
    assert done.stdout.strip() == tokenizer.decode(ids).strip()

    # Without a message, every line of stdin is a turn of one conversation.
    conversation = _chat(mesh, stdin=f"{message}\nAnd to the moon?\n")
    assert conversation.returncode == 0, conversation.stderr
    assert conversation.stdout.startswith(done.stdout)
    assert conversation.stderr.count(" generated, finish=") == 2, conversation.stderr


MESH_ENGINE_FLAGS = ["--dtype", "float32", "--cpu-weights", "fp16", "--kv-cache-mib", "64"]


def test_mesh_command_serves_then_stops_its_children():
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "mesh", "--gateway-port", "0", "--http-port", "0",
         "--worker-port", "0", "--demo-max-tokens", "8", "--grace-period", "20",
         *MESH_ENGINE_FLAGS],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    try:
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 300
        while not any("Ctrl-C stops the mesh" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        [ready] = [line.split() for line in lines if line.startswith("tandem mesh ready")]
        gateway, http = (word.split("=")[1] for word in ready[3:])
        with TandemClient(gateway) as client:
            assert client.list_models()[0].id == "SmolLM2-135M-Instruct"
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=30) as models:
            [model] = json.load(models)["data"]
        assert model["id"] == "SmolLM2-135M-Instruct"
        # The engine flags reached both workers, whose load reports told the gateway; quantization
        # auto serves the shipped file's own blocks on a CPU.
        assert (model["dtype"], model["quantization"], model["cpu_weights"], model["kv_cache_dtype"],
                model["activation_quantization"]) == ("float32", "gguf", "fp16", "float32", "none")
        assert any(f"curl http://{http}/v1/chat/completions" in line for line in lines), "".join(lines)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as children:
            child_pids = [int(pid) for pid in children.read().split()]
        assert len(child_pids) == 3
        # Regression: the mesh once picked free ports itself and passed them on, and another
        # process could take one before the worker bound it; asked for 0, a worker binds 0 itself.
        for pid in child_pids:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if "gateway" in argv:  # by default the gateway places requests on two colocated workers
                assert "--colocated" in argv and "--prefill" not in argv, argv
            else:
                assert argv[argv.index("--port") + 1] == "0", argv
                flags = MESH_ENGINE_FLAGS[::2]
                assert [argv[argv.index(flag) + 1] for flag in flags] == MESH_ENGINE_FLAGS[1::2], argv
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in child_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert any("TTFT" in line for line in lines), "".join(lines)
