"""LoRA adapters served by a disaggregated prefill + decode pair of real worker processes (both
`--enable-lora --lora-modules`), the adapters random peft ones over the shipped base: the pair's
greedy tokens under an adapter are the one-process engine's (and a resumed stream's, as migration
sends it, continue them); a prefill worker serving another adapter under the same name is refused
naming it, no block held on either side; the LoraAdapters service loads and unloads adapters
with each refusal's code, a failed load changing nothing; and loads and unloads while requests
run fail none of them. One pair of workers for the module; beside it, a colocated worker at
`--tensor-parallel-size 3` serving the adapter and the base in one batch as the one-process engine
does (the shipped base's 9 query heads split over 3 ranks, not 2)."""

from __future__ import annotations

import dataclasses
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS, ReferenceRun, check_runs, engine_reference
from tandem.v1 import decode_pb2, decode_pb2_grpc, lora_pb2, lora_pb2_grpc
from worker_calls import decode_call, load_report, no_blocks_used, until, workers_running

from engine.config import CacheConfig, LoraConfig
from engine.sampling_params import SamplingParams
from harness.lora_adapters import save_adapter
from harness.worker import WorkerProcess
from services.common.convert import sampling_params_to_proto
from services.common.server import channel_options

ADAPTER = "tuned"
COMMON = ["--port", "0", "--threads", "1", "--kv-cache-mib", "32", *PINNED_FLAGS,
          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]


def _greedy(name: str = "", max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=name)


@pytest.fixture(scope="module")
def adapter_dirs(model_files, tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("adapters"), model_files.config
    narrow = dataclasses.replace(base, hidden_size=base.hidden_size // 2, head_dim=base.head_dim // 2)
    return {"tuned": save_adapter(root / "tuned", base, 8, seed=1),
            "impostor": save_adapter(root / "impostor", base, 8, seed=2),
            "extra": save_adapter(root / "extra", base, 4, seed=3),
            "rank32": save_adapter(root / "rank32", base, 32, seed=4),
            "other-base": save_adapter(root / "other-base", narrow, 4, seed=5),
            "lm-head": save_adapter(root / "lm-head", base, 4, seed=6, modules=("q_proj", "lm_head"))}


@pytest.fixture(scope="module")
def workers(adapter_dirs) -> Iterator[dict[str, WorkerProcess]]:
    modules = ["--lora-modules", f"{ADAPTER}={adapter_dirs['tuned']}"]
    with workers_running({"decode": ["decode", *COMMON, *modules],
                          "prefill": ["prefill", *COMMON, *modules]}) as started:
        yield started


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("A short story about a lighthouse keeper who finds a message in a bottle:")


@pytest.fixture(scope="module")
def expected(make_engine, adapter_dirs, prompt) -> dict[str, ReferenceRun]:
    """The one-process engine's greedy run of the prompt under the adapter and under the base."""
    engine = make_engine(cache=CacheConfig(num_blocks=64),
                         lora=LoraConfig(max_lora_rank=16, modules=((ADAPTER, str(adapter_dirs["tuned"])),)))
    under, base = engine_reference(engine, [prompt, prompt], [_greedy(ADAPTER), _greedy()])
    assert under.token_ids != base.token_ids  # the adapter shows in the tokens: a test that can fail
    return {ADAPTER: under, "": base}


def _tokens(call) -> list[int]:
    return [token for chunk in call for token in chunk.token_ids]


def _lora(worker: WorkerProcess) -> lora_pb2_grpc.LoraAdaptersStub:
    return lora_pb2_grpc.LoraAdaptersStub(grpc.insecure_channel(worker.address, options=channel_options()))


def _load(worker: WorkerProcess, name: str, path: Path) -> bytes:
    return _lora(worker).LoadLoraAdapter(lora_pb2.LoadLoraAdapterRequest(name=name, path=str(path)),
                                         timeout=60).fingerprint


def _unload(worker: WorkerProcess, name: str) -> None:
    _lora(worker).UnloadLoraAdapter(lora_pb2.UnloadLoraAdapterRequest(name=name), timeout=60)


def _served(worker: WorkerProcess) -> dict[str, bytes]:
    return {state.name: state.fingerprint for state in load_report(worker).lora_adapters}


def _generate(decode: WorkerProcess, prompt: list[int], params: SamplingParams, resumed: list[int] = (),
              prefill: WorkerProcess | None = None):
    """A request on the decode worker, its prompt computed there or by `prefill`; with `resumed`, a
    stream moved from another decode worker (migration) after the client had those tokens."""
    channel = grpc.insecure_channel(decode.address, options=channel_options())
    request = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling=sampling_params_to_proto(params),
                                       output_token_ids=resumed, prefill_address=prefill.address if prefill else "")
    return decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=300)


def _metric(worker: WorkerProcess, name: str) -> list:
    with urllib.request.urlopen(f"http://{worker.metrics_address}/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
        return [sample for family in families for sample in family.samples if sample.name == name]


def test_the_pair_computes_under_the_adapter_as_one_process_does(workers, adapter_dirs, prompt, expected):
    decode, prefill = workers["decode"], workers["prefill"]
    for name in (ADAPTER, ""):
        check_runs([_tokens(decode_call(decode, prefill, prompt, _greedy(name)))], [expected[name]],
                   f"disaggregated under {name or 'the base'}")
    # A stream moved to another decode worker resumes from the tokens its client has, under its adapter.
    tokens = expected[ADAPTER].token_ids
    resumed = dataclasses.replace(expected[ADAPTER], token_ids=tokens[4:], margins=expected[ADAPTER].margins[4:])
    for computed_by in (None, prefill):
        check_runs([_tokens(_generate(decode, prompt, _greedy(ADAPTER), tokens[:4], computed_by))], [resumed],
                   f"resumed, computed by {'the prefill worker' if computed_by else 'the decode worker'}")
    for worker in (decode, prefill):
        report = load_report(worker)
        assert report.max_loras == 2
        (state,) = report.lora_adapters
        assert (state.name, state.rank, state.path, state.in_memory) == (ADAPTER, 8, str(adapter_dirs["tuned"]), True)
    assert _served(decode) == _served(prefill)
    (info,) = _metric(decode, "vllm:lora_requests_info")
    assert info.labels["max_lora"] == "2" and info.value > 0
    generated = _metric(decode, "vllm:generation_tokens_total")
    assert any(sample.labels["model_name"] == ADAPTER and sample.value > 0 for sample in generated)
    no_blocks_used(prefill, decode)


def test_a_worker_at_three_tensor_parallel_ranks_serves_the_adapter_and_the_base_in_one_batch(adapter_dirs, prompt,
                                                                                              expected):
    args = ["worker", "--role", "colocated", *COMMON, "--tensor-parallel-size", "3",
            "--lora-modules", f"{ADAPTER}={adapter_dirs['tuned']}"]
    with workers_running({"colocated": args}) as started:
        worker = started["colocated"]
        assert len(worker.tensor_parallel_ranks()) == 2
        # Both sent before either is read: the worker's first steps take them together.
        calls = {name: _generate(worker, prompt, _greedy(name)) for name in (ADAPTER, "")}
        for name, call in calls.items():
            check_runs([_tokens(call)], [expected[name]], f"TP 3 worker under {name or 'the base'}")
        # A step of 2 to 8 tokens is both requests decoding together (the prompt is 15 tokens):
        # the adapter's rows and the base's shared a batch, as the test claims.
        steps = _metric(worker, "vllm:iteration_tokens_total_bucket")
        up_to = {le: sum(s.value for s in steps if s.labels["le"] == le) for le in ("1.0", "8.0")}
        assert up_to["8.0"] > up_to["1.0"], steps


def test_a_prefill_worker_serving_another_adapter_under_the_name_is_refused(workers, adapter_dirs, prompt):
    decode, prefill = workers["decode"], workers["prefill"]
    _unload(prefill, ADAPTER)
    _load(prefill, ADAPTER, adapter_dirs["impostor"])
    try:
        assert _served(prefill)[ADAPTER] != _served(decode)[ADAPTER]
        with pytest.raises(grpc.RpcError) as error:
            _tokens(decode_call(decode, prefill, prompt, _greedy(ADAPTER)))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION, error.value.details()
        assert f"adapter '{ADAPTER}'" in error.value.details()
        no_blocks_used(prefill, decode)
    finally:
        _unload(prefill, ADAPTER)
        _load(prefill, ADAPTER, adapter_dirs["tuned"])
    assert _served(prefill) == _served(decode)


@pytest.mark.parametrize(("name", "directory", "code", "message"), [
    ("x", "other-base", grpc.StatusCode.INVALID_ARGUMENT, "'x'.*another base"),
    ("x", "rank32", grpc.StatusCode.INVALID_ARGUMENT, "'x'.*rank 32 is above --max-lora-rank 16"),
    ("x", "lm-head", grpc.StatusCode.INVALID_ARGUMENT, "'x'.*lm_head.* not served"),
    ("x", "missing", grpc.StatusCode.INVALID_ARGUMENT, "'x'.*not a directory"),
    (ADAPTER, "extra", grpc.StatusCode.INVALID_ARGUMENT, f"'{ADAPTER}' is already loaded"),
])
def test_a_load_that_cannot_be_served_is_refused_and_changes_nothing(workers, adapter_dirs, name, directory,
                                                                     code, message):
    decode = workers["decode"]
    before = _served(decode)
    with pytest.raises(grpc.RpcError) as error:
        _load(decode, name, adapter_dirs.get(directory, Path("/nonexistent")))
    assert error.value.code() == code
    assert re.search(message, error.value.details()), error.value.details()
    assert _served(decode) == before


def test_load_unload_and_their_refusals_over_the_worker_rpc(workers, adapter_dirs, prompt, tokenizer):
    decode = workers["decode"]
    served_name = load_report(decode).model_name
    with pytest.raises(grpc.RpcError) as error:
        _load(decode, served_name, adapter_dirs["extra"])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "served model's name" in error.value.details()
    fingerprint = _load(decode, "extra", adapter_dirs["extra"])
    assert _served(decode)["extra"] == fingerprint and len(fingerprint) == 16
    call = _generate(decode, prompt, _greedy("extra", max_tokens=400))
    next(iter(call))  # running now
    with pytest.raises(grpc.RpcError) as error:
        _unload(decode, "extra")
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "'extra'" in error.value.details()
    call.cancel()
    until(lambda: not any(s.running_requests or s.waiting_requests for s in load_report(decode).lora_adapters),
          "the cancelled request still holds its adapter")
    _unload(decode, "extra")
    assert set(_served(decode)) == {ADAPTER}
    for refused in (lambda: _unload(decode, "extra"), lambda: _tokens(_generate(decode, prompt, _greedy("extra")))):
        with pytest.raises(grpc.RpcError) as error:
            refused()
        assert error.value.code() == grpc.StatusCode.NOT_FOUND and "'extra'" in error.value.details()


def test_loads_and_unloads_while_requests_run_fail_none(workers, adapter_dirs, prompt, expected):
    decode, prefill = workers["decode"], workers["prefill"]
    results: dict[int, list[int] | Exception] = {}

    def run(index: int) -> None:
        name = ADAPTER if index % 2 else ""
        try:
            results[index] = _tokens(decode_call(decode, prefill, prompt, _greedy(name)))
        except Exception as error:  # reported below, naming the request
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    rounds = 0
    while any(thread.is_alive() for thread in threads) or rounds < 2:
        for worker in (decode, prefill):
            _load(worker, "extra", adapter_dirs["extra"])
        for worker in (decode, prefill):
            _unload(worker, "extra")
        rounds += 1
    for thread in threads:
        thread.join()
    failed = {index: result for index, result in results.items() if isinstance(result, Exception)}
    assert not failed, failed
    for index, tokens in sorted(results.items()):
        check_runs([tokens], [expected[ADAPTER if index % 2 else ""]], f"request {index}")
    no_blocks_used(prefill, decode)
