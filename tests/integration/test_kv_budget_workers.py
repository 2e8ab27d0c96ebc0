"""A decode worker with a KV budget (--kv-budget-tokens) fed by prefill workers as real processes:
a prefill worker with a budget of its own scores the prompt and pushes only the blocks the decode
worker's budget keeps (its byte counter says so), and the tokens are those of an in-process
colocated engine under the same budget; one without a budget refuses, naming kv_budget; a cancel
while the older blocks are held frees every block on both sides."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from parity_prompts import parity_prompt_ids
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS, check_runs, engine_reference
from worker_calls import decode_call, load_report, no_blocks_used, prefill_began, until, workers_running

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache.blocks import blocks_for
from engine.sampling_params import SamplingParams
from harness.worker import WorkerProcess
from kvtransfer.descriptor import KVLayout

BUDGET, RECENT, BLOCK, CHUNK = 64, 16, 16, 200
BUDGET_FLAGS = ["--kv-budget-tokens", str(BUDGET), "--kv-budget-recent-tokens", str(RECENT)]
COMMON = ["--port", "0", "--threads", "1", "--kv-cache-mib", "64", "--max-num-batched-tokens", str(CHUNK),
          *PINNED_FLAGS]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProcess]]:
    """A budgeted decode worker, a prefill worker with the same budget and one without any."""
    with workers_running({"decode": ["decode", *COMMON, *BUDGET_FLAGS],
                          "prefill": ["prefill", *COMMON, *BUDGET_FLAGS],
                          "plain": ["prefill", *COMMON]}) as started:
        yield started


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return parity_prompt_ids(tokenizer)[3][:300]  # 19 blocks, the last partly filled: 4 kept


def _counter(worker: WorkerProcess, name: str, **labels: str) -> float:
    """The sum of a worker's samples called `name` with `labels` among theirs."""
    with urllib.request.urlopen(f"http://{worker.metrics_address}/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(sample.value for family in families for sample in family.samples
                   if sample.name == name and labels.items() <= sample.labels.items())


def _kv_bytes_pushed(prefill: WorkerProcess) -> float:
    return _counter(prefill, "tandem:kv_transfer_bytes_total")


def _budget_steps(worker: WorkerProcess) -> dict[str, float]:
    return {attention: _counter(worker, "tandem:kv_budget_steps_total", attention=attention)
            for attention in ("regular", "scored")}


def test_only_the_kept_blocks_move_and_the_tokens_are_colocated_budgeted_serving(workers, prompt, make_engine):
    decode, prefill = workers["decode"], workers["prefill"]
    colocated = make_engine(cache=CacheConfig(block_size=BLOCK, num_blocks=64, budget_tokens=BUDGET,
                                              budget_recent_tokens=RECENT),
                            scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK), cpu_weights="plain")
    [expected] = engine_reference(colocated, [prompt], [GREEDY])
    # The budget changes this prompt's tokens: pages in the wrong places, or all of them, would show.
    full = make_engine(cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK), cpu_weights="plain")
    assert engine_reference(full, [prompt], [GREEDY])[0].token_ids != expected.token_ids
    layout = KVLayout.of_engine(colocated)
    pushed = _kv_bytes_pushed(prefill)
    steps = {worker: _budget_steps(worker) for worker in (prefill, decode)}
    chunks = list(decode_call(decode, prefill, prompt, GREEDY))
    check_runs([[t for c in chunks for t in c.token_ids]], [expected], "budgeted disaggregated")
    # The budget's 4 of the prompt's 19 blocks moved, K and V of every layer.
    assert blocks_for(len(prompt), BLOCK) == 19
    assert _kv_bytes_pushed(prefill) - pushed == BUDGET // BLOCK * 2 * layout.num_layers * layout.block_bytes
    # The prompt's first chunk (200 tokens) ends before its observation window: the regular
    # attention; its second scores. The decode worker's every step scores (its first token came with the prompt).
    after = {worker: _budget_steps(worker) for worker in (prefill, decode)}
    assert {k: after[prefill][k] - steps[prefill][k] for k in after[prefill]} == {"regular": 1, "scored": 1}
    assert {k: after[decode][k] - steps[decode][k] for k in after[decode]} == {"regular": 0,
                                                                                "scored": GREEDY.max_tokens - 1}
    no_blocks_used(prefill, decode)


def test_a_prefill_worker_without_a_budget_refuses_naming_it_and_nothing_leaks(workers, prompt):
    decode, plain = workers["decode"], workers["plain"]
    with pytest.raises(grpc.RpcError) as error:
        list(decode_call(decode, plain, prompt, GREEDY))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_budget: this worker scores no blocks" in error.value.details()
    no_blocks_used(plain, decode)


def test_a_cancel_while_the_older_blocks_are_held_frees_every_block(workers, prompt):
    decode, prefill = workers["decode"], workers["prefill"]
    # A prompt new to both workers, of several 200-token steps, its older blocks held until the last.
    ended = load_report(prefill).finished_requests
    began = prefill_began(prefill)
    call = decode_call(decode, prefill, [t + 1 for t in prompt * 3], GREEDY)
    until(began, "the prefill never started")
    call.cancel()
    no_blocks_used(prefill, decode)
    until(lambda: load_report(prefill).finished_requests == ended + 1, "the prefill never ended")
