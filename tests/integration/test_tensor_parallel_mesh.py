"""Prefill and decode workers of different tensor-parallel sizes as real processes (each TP 3 worker
and its two other ranks, gloo): prefill TP 3 -> decode TP 1 and prefill TP 1 -> decode TP 3 over
both KV backends decode as the one-process engine does, prefix caching included; a cancel mid-transfer
and a killed rank leave no block held on either side. Blocks belong to each worker's rank 0 (its
other ranks hold pages of the same block ids, never blocks of their own), so a worker's load report
covers every rank."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from parity_prompts import parity_prompt_ids
from reference import PINNED_FLAGS, check_against, margins_of
from worker_calls import decode_call, kill_a_rank_mid_transfer, load_report, no_blocks_used, prefill_began, until

from engine.config import SchedulerConfig
from engine.offline import generate
from engine.sampling_params import SamplingParams
from harness.worker import WorkerProcess, start_worker

CHUNK_TOKENS = "200"  # prefill in chunks that end mid-block: a partly filled block's pages go twice
COMMON = ["--port", "0", "--threads", "1", "--kv-cache-mib", "64", *PINNED_FLAGS]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
BACKENDS = ["grpc", "torch_dist"]
_killed: set[int] = set()  # pids of workers a test took down on purpose (they exit 1)


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProcess]]:
    """Every worker of the module, started at once (their loads overlap): prefill_tp3, prefill_tp1,
    decode_tp1 / decode_tp3 on each backend ("decode_tp3_grpc"), and the victims of the rank kills."""
    roles = {"prefill_tp3": ("prefill", 3), "prefill_tp1": ("prefill", 1)}
    roles |= {f"decode_tp{size}_{backend}": ("decode", size, "--kv-backend", backend)
              for size in (1, 3) for backend in BACKENDS}
    # The rank-killing tests' own: each is taken down by one test.
    roles |= {"victim_prefill_tp3": ("prefill", 3), "victim_decode_tp3_torch_dist": ("decode", 3, "--kv-backend",
                                                                                    "torch_dist")}
    started = {name: start_worker([role, *COMMON, "--max-num-batched-tokens", CHUNK_TOKENS,
                                   "--tensor-parallel-size", str(size), *flags], wait=False)
               for name, (role, size, *flags) in roles.items()}
    try:
        for worker in started.values():
            worker.wait_ready()
        yield started
    finally:
        codes = {name: (worker.stop(), worker.proc.pid in _killed) for name, worker in started.items()}
    assert all(code == (1 if killed else 0) for code, killed in codes.values()), codes


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = parity_prompt_ids(tokenizer)
    return [ids[0], ids[4]]


@pytest.fixture(scope="module")
def reference(make_engine, prompts) -> tuple[list[list[int]], list[list[float]]]:
    engine = make_engine(scheduler=SchedulerConfig(max_num_batched_tokens=int(CHUNK_TOKENS)))
    completions = generate(engine, prompts, SamplingParams(**{**GREEDY.__dict__, "logprobs": 2}))
    return ([c.token_ids for c in completions],
            [[top[0][1] - top[1][1] for top in (lp.top for lp in c.logprobs)] for c in completions])


def _decodes_as_one_process(prefill: WorkerProcess, decode: WorkerProcess, prompts, reference, what: str) -> None:
    expected, margins = reference
    # Twice: the second time both sides hit their prefix caches (per rank), so fewer pages move.
    for attempt in range(2):
        chunks = [list(decode_call(decode, prefill, prompt, GREEDY)) for prompt in prompts]
        ours = [[t for c in stream for t in c.token_ids] for stream in chunks]
        check_against(ours, expected, margins, f"{what}, attempt {attempt}")
        assert attempt == 0 or chunks[1][-1].usage.cached_tokens >= 16
    no_blocks_used(prefill, decode)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_tp3_to_decode_tp1_decodes_as_one_process(workers, backend, prompts, reference):
    prefill, decode = workers["prefill_tp3"], workers[f"decode_tp1_{backend}"]
    _decodes_as_one_process(prefill, decode, prompts, reference, f"prefill TP 3 -> decode TP 1 over {backend}")
    assert (load_report(prefill).tensor_parallel_size, load_report(decode).tensor_parallel_size) == (3, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_tp1_to_decode_tp3_decodes_as_one_process(workers, backend, prompts, reference):
    prefill, decode = workers["prefill_tp1"], workers[f"decode_tp3_{backend}"]
    _decodes_as_one_process(prefill, decode, prompts, reference, f"prefill TP 1 -> decode TP 3 over {backend}")


def _cancel_mid_transfer(prefill: WorkerProcess, decode: WorkerProcess, prompt: list[int]) -> None:
    began = prefill_began(prefill)
    call = decode_call(decode, prefill, prompt, LONG)
    # A fresh ~1,000-token prompt takes several 200-token steps, each pushing its pages.
    until(began, "the prefill never started")
    call.cancel()
    no_blocks_used(prefill, decode)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_mid_transfer_between_layouts_frees_every_block(workers, backend, tokenizer):
    diary = parity_prompt_ids(tokenizer)[3]
    shift = BACKENDS.index(backend)  # fresh prompts: no prefix-cache hit shortens the transfer
    _cancel_mid_transfer(workers["prefill_tp3"], workers[f"decode_tp1_{backend}"], [t + 1 + shift for t in diary])
    _cancel_mid_transfer(workers["prefill_tp1"], workers[f"decode_tp3_{backend}"], [t + 3 + shift for t in diary])


def _kill_a_rank_mid_transfer(victim: WorkerProcess, prefill: WorkerProcess, decode: WorkerProcess,
                              prompt: list[int], failed: set[grpc.StatusCode], make_engine) -> None:
    """Kill one of `victim`'s two other ranks mid-transfer (worker_calls.kill_a_rank_mid_transfer)."""
    assert len(victim.tensor_parallel_ranks()) == 2

    def expected(prompt: list[int]) -> tuple[list[int], list[float]]:
        engine = make_engine(scheduler=SchedulerConfig(max_num_batched_tokens=int(CHUNK_TOKENS)))
        [completion] = generate(engine, [prompt], replace(LONG, logprobs=2))
        return completion.token_ids, margins_of(completion)

    _killed.add(victim.proc.pid)
    kill_a_rank_mid_transfer(victim, prefill, decode, prompt, LONG, failed, expected)


# These take TP 3 workers of their own down (the victims), so that no other test depends on running
# before them. torch_dist, where a stuck pair could hang. The decode worker fails a request whose
# prefill worker or transfer failed UNAVAILABLE; a decode worker that lost a rank fails what it
# holds INTERNAL (its engine step or page relay failed), or UNAVAILABLE where its exit cut the stream first.
def test_a_killed_prefill_rank_leaves_no_block_held_on_the_decode_side(workers, tokenizer, make_engine):
    prefill = workers["victim_prefill_tp3"]
    _kill_a_rank_mid_transfer(prefill, prefill, workers["decode_tp1_torch_dist"],
                              [t + 5 for t in parity_prompt_ids(tokenizer)[3]], {grpc.StatusCode.UNAVAILABLE},
                              make_engine)


def test_a_killed_decode_rank_leaves_no_block_held_on_the_prefill_side(workers, tokenizer, make_engine):
    decode = workers["victim_decode_tp3_torch_dist"]
    _kill_a_rank_mid_transfer(decode, workers["prefill_tp1"], decode, [t + 6 for t in parity_prompt_ids(tokenizer)[3]],
                              {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}, make_engine)
