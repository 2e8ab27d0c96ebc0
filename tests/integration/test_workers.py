"""Prefill and decode workers as real processes: one request straight to Decode/Generate, its KV
pushed by the prefill worker over each backend, against an in-process colocated engine."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from parity_prompts import parity_prompt_ids
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS, ReferenceRun, check_runs, engine_reference
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from worker_calls import workers_running

from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker
from services.common.convert import sampling_params_to_proto
from services.common.server import channel_options

# Prefill in chunks that end mid-block, so pages of a partly filled block are pushed twice.
CHUNK_TOKENS = "200"
COMMON = ["--port", "0", "--threads", "1", "--kv-cache-mib", "64", *PINNED_FLAGS]
DEADLINE_S = 60.0  # generous bound for conditions polled below; no test asserts elapsed time
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProcess]]:
    """The module's workers, started together so that their loads overlap: the prefill worker; a
    decode worker per KV backend; one with a 4-block cache of 32-token blocks (the prefill worker's
    are 16); one whose KV cache is fp8 (the prefill worker's is the auto fp32 one)."""
    arg_lists = {
        "prefill": ["prefill", *COMMON, "--max-num-batched-tokens", CHUNK_TOKENS],
        "torch_dist": ["decode", *COMMON, "--kv-backend", "torch_dist"],
        "grpc": ["decode", *COMMON, "--kv-backend", "grpc"],
        "small": ["decode", *COMMON, "--block-size", "32", "--kv-cache-blocks", "4"],
        "fp8": ["decode", *COMMON, "--kv-cache-dtype", "fp8"],
    }
    with workers_running(arg_lists) as started:
        yield started


@pytest.fixture(scope="module")
def prefill(workers: dict[str, WorkerProcess]) -> WorkerProcess:
    return workers["prefill"]


@pytest.fixture(scope="module", params=["torch_dist", "grpc"])
def decode(request, workers: dict[str, WorkerProcess]) -> WorkerProcess:
    return workers[request.param]


@pytest.fixture(scope="module")
def small_decode(workers: dict[str, WorkerProcess]) -> WorkerProcess:
    return workers["small"]


@pytest.fixture(scope="module")
def fp8_decode(workers: dict[str, WorkerProcess]) -> WorkerProcess:
    return workers["fp8"]


def _channel(worker: WorkerProcess) -> grpc.Channel:
    return grpc.insecure_channel(worker.address, options=channel_options())


def _decode_stub(worker: WorkerProcess) -> decode_pb2_grpc.DecodeStub:
    return decode_pb2_grpc.DecodeStub(_channel(worker))


def _load(worker: WorkerProcess) -> common_pb2.LoadReport:
    stub = (decode_pb2_grpc.DecodeStub if worker.args[0] == "decode" else prefill_pb2_grpc.PrefillStub)(
        _channel(worker))
    return stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _prefilling(prefill: WorkerProcess) -> bool:
    """Whether the prefill worker's engine holds a prompt it has not finished computing."""
    report = _load(prefill)
    return report.running_requests + report.waiting_requests > 0


def _prefills_delivered(prefill: WorkerProcess) -> float:
    """Prefills the worker completed and delivered: only those reach its TTFT histogram."""
    with urllib.request.urlopen(f"http://{prefill.metrics_address}/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(sample.value for family in families for sample in family.samples
                   if sample.name == "vllm:time_to_first_token_seconds_count")


def _wait_until_no_blocks_used(*workers: WorkerProcess) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        used = [_load(w).used_kv_blocks for w in workers]
        if not any(used) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert used == [0] * len(workers)


def _request(
    prompt: list[int], prefill: WorkerProcess, params: SamplingParams = GREEDY, **fields
) -> decode_pb2.DecodeRequest:
    """A DecodeRequest; `fields` override any of its fields."""
    base = {"prompt_token_ids": prompt, "sampling": sampling_params_to_proto(params),
            "prefill_address": prefill.address}
    return decode_pb2.DecodeRequest(**(base | fields))


def _generate(stub: decode_pb2_grpc.DecodeStub, request: decode_pb2.DecodeRequest) -> list[common_pb2.TokenChunk]:
    return list(stub.Generate(request, timeout=120))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = parity_prompt_ids(tokenizer)
    return [ids[0], ids[4], ids[3]]  # short plain, chat, and the ~1,000-token diary


@pytest.fixture(scope="module")
def reference(make_engine, prompts) -> list[ReferenceRun]:
    """The prompts run together on a colocated engine: the workers run each alone, in other batch
    shapes, so outputs are compared by the near-tie rule (check_runs)."""
    engine = make_engine(scheduler=SchedulerConfig(max_num_batched_tokens=int(CHUNK_TOKENS)))
    return engine_reference(engine, prompts, [GREEDY] * len(prompts))


def test_disaggregated_greedy_tokens_equal_colocated(prefill, decode, prompts, reference):
    stub = _decode_stub(decode)
    finished_before = _load(decode).finished_requests
    # Twice: the second time both workers hit their prefix caches, so fewer pages move.
    for attempt in range(2):
        for prompt, expected in zip(prompts, reference, strict=True):
            chunks = _generate(stub, _request(prompt, prefill))
            check_runs([[t for c in chunks for t in c.token_ids]], [expected], f"attempt {attempt}")
            final = chunks[-1]
            assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), len(expected.token_ids))
            timings = final.timings
            assert timings.e2e_s >= timings.ttft_s > timings.kv_delivery_wait_s > 0
            # TTFT's parts at the decode worker add up to at most its TTFT (the rest is RPC hops).
            parts = (timings.reserve_s, timings.prefill_queue_s, timings.prefill_compute_s, timings.kv_wait_s,
                     timings.batch_join_s)
            assert timings.reserve_s > 0 and timings.batch_join_s > 0 and sum(parts) <= timings.ttft_s
        # The prefill worker has seen every prompt by now: at least the diary's blocks were cached.
        assert attempt == 0 or final.usage.cached_tokens >= 16
    _wait_until_no_blocks_used(prefill, decode)
    assert _load(decode).finished_requests == finished_before + 2 * len(prompts)


def test_a_first_token_that_ends_the_request_still_comes_with_usage(prefill, decode, prompts, reference):
    chunks = _generate(_decode_stub(decode), _request(prompts[0], prefill, SamplingParams(max_tokens=1, temperature=0)))
    [chunk] = chunks
    first = ReferenceRun(reference[0].token_ids[:1], reference[0].margins[:1])
    check_runs([list(chunk.token_ids)], [first], "first token")
    assert chunks[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[0].usage.completion_tokens == 1
    _wait_until_no_blocks_used(prefill, decode)


def test_without_a_prefill_address_the_decode_worker_prefills_itself(prefill, decode, prompts, reference):
    # Conditional disaggregation: the same greedy tokens, with nothing asked of the prefill worker.
    stub = _decode_stub(decode)
    prefilled_before = _load(prefill).finished_requests
    for prompt, expected in zip(prompts, reference, strict=True):
        chunks = _generate(stub, _request(prompt, prefill, prefill_address=""))
        check_runs([[t for c in chunks for t in c.token_ids]], [expected], "local prefill")
        timings = chunks[-1].timings
        assert timings.kv_delivery_wait_s == timings.reserve_s == timings.batch_join_s == 0
    assert _load(prefill).finished_requests == prefilled_before
    _wait_until_no_blocks_used(prefill, decode)


def test_bad_input_is_invalid_argument_naming_the_field(prefill, decode, prompts):
    stub = _decode_stub(decode)
    for request, field in [
        (_request(prompts[0], prefill, sampling=common_pb2.SamplingParams(top_p=0.0)), "top_p"),
        (_request([1, 2, 10**9], prefill), "prompt_token_ids"),
    ]:
        with pytest.raises(grpc.RpcError) as error:
            _generate(stub, request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith(f"{field}:")
    _wait_until_no_blocks_used(prefill, decode)


def test_a_prompt_the_cache_cannot_hold_is_resource_exhausted(prefill, small_decode, prompts):
    with pytest.raises(grpc.RpcError) as error:
        _generate(_decode_stub(small_decode), _request(prompts[2], prefill))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _wait_until_no_blocks_used(small_decode)


def test_a_layout_mismatch_is_failed_precondition_naming_block_size(prefill, small_decode, prompts):
    with pytest.raises(grpc.RpcError) as error:
        _generate(_decode_stub(small_decode), _request(prompts[0], prefill))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size" in error.value.details()
    _wait_until_no_blocks_used(prefill, small_decode)


def test_a_kv_dtype_mismatch_is_failed_precondition_naming_it(prefill, fp8_decode, prompts):
    with pytest.raises(grpc.RpcError) as error:
        _generate(_decode_stub(fp8_decode), _request(prompts[0], prefill))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype: float32 here, fp8_e4m3 there" in error.value.details()
    _wait_until_no_blocks_used(prefill, fp8_decode)


LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def test_cancel_mid_stream_frees_every_block(prefill, decode, prompts):
    call = _decode_stub(decode).Generate(_request(prompts[2], prefill, LONG), timeout=120)
    first = next(call)
    assert first.token_ids
    call.cancel()
    _wait_until_no_blocks_used(prefill, decode)


def test_cancel_during_prefill_frees_every_block(prefill, decode, prompts):
    # A fresh prompt (no prefix-cache hit): its ~1,000 tokens take several 200-token prefill steps.
    prompt = [t + 1 for t in prompts[2]]
    delivered, ended = _prefills_delivered(prefill), _load(prefill).finished_requests
    call = _decode_stub(decode).Generate(_request(prompt, prefill, LONG), timeout=120)
    _until(lambda: _prefilling(prefill))
    call.cancel()
    _wait_until_no_blocks_used(prefill, decode)
    # The prefill worker's request ended without delivering its pages: the cancel landed mid-prefill.
    _until(lambda: _load(prefill).finished_requests == ended + 1)
    assert _prefills_delivered(prefill) == delivered


def test_abort_rpc_ends_the_stream_cancelled(prefill, decode, prompts):
    stub = _decode_stub(decode)
    call = stub.Generate(_request(prompts[0], prefill, LONG, request_id="to-abort"), timeout=120)
    next(call)
    assert stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    _wait_until_no_blocks_used(prefill, decode)


def test_health_is_not_serving_until_the_model_is_loaded():
    port = free_port()
    worker = start_worker(["prefill", *COMMON, "--port", str(port)], wait=False)
    try:
        # Reconnect quickly: the server comes up while the test is already knocking.
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 50)])
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), wait_for_ready=True,
                                                           timeout=300)
        statuses = [next(watch).status, next(watch).status]
        watch.cancel()
        assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
        assert worker.wait_ready() == f"127.0.0.1:{port}"
    finally:
        assert worker.stop() == 0, worker.log_tail()


def test_watch_load_streams_reports_until_the_client_goes(prefill):
    stub = prefill_pb2_grpc.PrefillStub(_channel(prefill))
    watch = stub.WatchLoad(common_pb2.WatchLoadRequest(interval_ms=20), timeout=60)
    reports = [next(watch) for _ in range(3)]
    watch.cancel()
    assert {(r.role, r.worker_id, r.block_size) for r in reports} == {("prefill", f"prefill@{prefill.address}", 16)}
    assert all(r.total_kv_blocks > 0 for r in reports)


def test_sigterm_refuses_new_rpcs_lets_the_running_stream_finish_then_exits_zero(prefill, prompts):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    decode = start_worker(["decode", *COMMON, "--grace-period", "120"])
    try:
        stub = _decode_stub(decode)
        call = stub.Generate(_request(prompts[0], prefill, params), timeout=120)
        chunks = [next(call)]
        decode.proc.terminate()
        # New calls are refused. One that raced the start of the drain may end CANCELLED instead, or
        # go unanswered until its deadline: gRPC core drops a call that reached it as shutdown began
        # (grpc/grpc#10418; seen once in CI), hence the short deadline.
        raced = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
        codes = []
        deadline = time.monotonic() + DEADLINE_S
        while grpc.StatusCode.UNAVAILABLE not in codes and time.monotonic() < deadline:
            try:
                stub.GetLoad(common_pb2.GetLoadRequest(), timeout=2)
            except grpc.RpcError as error:
                codes.append(error.code())
            time.sleep(0.01)
        assert codes[-1:] == [grpc.StatusCode.UNAVAILABLE] and set(codes[:-1]) <= raced
        chunks += list(call)
        assert decode.proc.wait(60) == 0, decode.log_tail()
    finally:
        decode.stop()
    assert sum(len(c.token_ids) for c in chunks) == params.max_tokens
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_load_reports_carry_the_step_model_fitted_at_start_up(prefill, decode):
    prefill_model = _load(prefill).step_model
    assert prefill_model.per_prompt_token_s > 0
    assert _load(prefill).max_num_batched_tokens == int(CHUNK_TOKENS)
    decode_model = _load(decode).step_model
    # A decode step costs something whatever the batch: the weights are read once per step.
    assert decode_model.base_s + decode_model.per_sequence_s > 0
