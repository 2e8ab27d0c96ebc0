"""Worker processes of every parallel layout, disaggregated (each multi-process worker with its other
ranks, gloo), serving one mixture-of-experts model: prefill with experts split whole over 2 ranks
(--enable-expert-parallel) -> decode with every expert's features split over 2 ranks, and -> a
one-process decode worker; a prompt whose prefill 2 processes split by sequence
(--prefill-context-parallel-size); prefill PP 2 -> decode PP 1 and PP 1 -> PP 2 (--pipeline-parallel-size).
Each decodes as the one-process engine does; load reports and metrics say each worker's layout; a
cancel mid-transfer and a killed rank on either side leave no block held. The model is a random
Mixtral of small shapes saved by the test (a real MoE checkpoint would not fit the suite's time), so
its tokens are compared with the one-process engine, not with text."""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from reference import check_against
from transformers import MixtralConfig
from worker_calls import (
    DEADLINE_S,
    decode_call,
    kill_a_rank_mid_transfer,
    load_report,
    no_blocks_used,
    prefill_began,
    until,
)

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.offline import generate
from engine.sampling_params import SamplingParams
from harness.worker import WorkerProcess, start_worker
from tests.unit.test_model_hf import save_random_model, save_word_tokenizer

VOCAB = 96
FORMATS = ["--dtype", "float32", "--quantization", "none", "--cpu-weights", "fp32"]
COMMON = ["--port", "0", "--threads", "1", "--kv-cache-mib", "16", "--max-num-batched-tokens", "32", *FORMATS]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
_killed: set[int] = set()  # pids of workers a test took down on purpose (they exit 1)


def _prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mixtral")
    save_random_model(MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                    num_experts_per_tok=2, max_position_embeddings=1024, sliding_window=None,
                                    initializer_range=0.1), directory)
    save_word_tokenizer(directory, VOCAB)
    return directory


@pytest.fixture(scope="module")
def workers(model_dir) -> Iterator[dict[str, WorkerProcess]]:
    """Every worker of the module, started at once: prefill_ep2, prefill_cp2 (a long prompt's prefill
    split over 2 processes by sequence), prefill_pp2, prefill_tp1, decode_tp2, decode_pp2, decode_tp1,
    and the victims of the rank kills."""
    ep2, tp2 = ["--tensor-parallel-size", "2", "--enable-expert-parallel"], ["--tensor-parallel-size", "2"]
    cp2 = ["--prefill-context-parallel-size", "2", "--prefill-context-parallel-min-tokens", "48",
           "--max-num-batched-tokens", "1024"]  # after COMMON's budget: whole prompts, so they split
    pp2 = ["--pipeline-parallel-size", "2"]
    roles = {"prefill_ep2": ("prefill", *ep2), "decode_tp2": ("decode", *tp2), "decode_tp1": ("decode",),
             "prefill_cp2": ("prefill", *cp2), "prefill_pp2": ("prefill", *pp2), "decode_pp2": ("decode", *pp2),
             "prefill_tp1": ("prefill",), "victim_prefill_ep2": ("prefill", *ep2),
             "victim_decode_ep2": ("decode", *ep2), "victim_prefill_cp2": ("prefill", *cp2),
             "victim_prefill_pp2": ("prefill", *pp2), "victim_decode_pp2": ("decode", *pp2)}
    started = {name: start_worker([role, "--model", str(model_dir), *COMMON, *flags, *(
        ["--kv-backend", "torch_dist"] if role == "decode" else [])], wait=False)
        for name, (role, *flags) in roles.items()}
    try:
        for worker in started.values():
            worker.wait_ready()
        yield started
    finally:
        codes = {name: (worker.stop(), worker.proc.pid in _killed) for name, worker in started.items()}
    assert all(code == (1 if killed else 0) for code, killed in codes.values()), codes


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", quantization="none", cpu_weights="fp32",
                               cache=CacheConfig(num_blocks=64)))


def _expected(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    completions = generate(engine, prompts, SamplingParams(**{**params.__dict__, "logprobs": 2}))
    return ([c.token_ids for c in completions],
            [[top[0][1] - top[1][1] for top in (lp.top for lp in c.logprobs)] for c in completions])


def _served(prefill: WorkerProcess, decode: WorkerProcess, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, computed by `prefill` and decoded by `decode`."""
    return [[t for chunk in decode_call(decode, prefill, prompt, GREEDY) for t in chunk.token_ids]
            for prompt in prompts]


@pytest.mark.parametrize("decode_name", ["decode_tp2", "decode_tp1"])
def test_prefill_ep2_to_decode_of_another_layout_decodes_as_one_process(workers, engine, decode_name):
    prefill, decode = workers["prefill_ep2"], workers[decode_name]
    prompts = [_prompt(21, 1), _prompt(70, 2)]
    expected, margins = _expected(engine, prompts, GREEDY)
    ours = _served(prefill, decode, prompts)
    check_against(ours, expected, margins, f"prefill EP 2 -> {decode_name}")
    no_blocks_used(prefill, decode)
    layouts = {name: (load_report(workers[name]).tensor_parallel_size, load_report(workers[name]).expert_parallel_size)
               for name in ("prefill_ep2", decode_name)}
    assert layouts == {"prefill_ep2": (2, 2), decode_name: (2, 1) if decode_name == "decode_tp2" else (1, 1)}
    with urllib.request.urlopen(f"http://{prefill.metrics_address}/metrics", timeout=30) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    assert [sample.value for sample in families["tandem:expert_parallel_size"].samples] == [2]


def test_a_prompt_split_by_sequence_on_the_prefill_side_decodes_as_one_process(workers, engine):
    prefill, decode = workers["prefill_cp2"], workers["decode_tp2"]
    prompts = [_prompt(300, 7), _prompt(21, 8)]  # split, and not (below the threshold)
    expected, margins = _expected(engine, prompts, GREEDY)
    ours = _served(prefill, decode, prompts)
    check_against(ours, expected, margins, "prefill context parallel 2 -> decode TP 2")
    no_blocks_used(prefill, decode)
    assert load_report(prefill).prefill_context_parallel_size == 2


@pytest.mark.parametrize(("prefill_name", "decode_name"), [("prefill_pp2", "decode_tp1"),
                                                          ("prefill_tp1", "decode_pp2")])
def test_pipeline_layouts_pair_both_ways_and_decode_as_one_process(workers, engine, prefill_name, decode_name):
    prefill, decode = workers[prefill_name], workers[decode_name]
    prompts = [_prompt(21, 10), _prompt(70, 11)]
    expected, margins = _expected(engine, prompts, GREEDY)
    ours = _served(prefill, decode, prompts)
    check_against(ours, expected, margins, f"{prefill_name} -> {decode_name}")
    no_blocks_used(prefill, decode)
    assert (load_report(prefill).pipeline_parallel_size, load_report(decode).pipeline_parallel_size) == (
        (2, 1) if prefill_name == "prefill_pp2" else (1, 2))


@pytest.mark.parametrize(("prefill_name", "decode_name"), [("prefill_ep2", "decode_tp2"),
                                                          ("prefill_pp2", "decode_tp1"),
                                                          ("prefill_tp1", "decode_pp2")])
def test_cancel_mid_transfer_between_layouts_frees_every_block(workers, prefill_name, decode_name):
    prefill, decode = workers[prefill_name], workers[decode_name]
    began = prefill_began(prefill)
    call = decode_call(decode, prefill, _prompt(600, 3 + len(prefill_name) + len(decode_name)), LONG)
    # A 600-token prompt takes many 32-token steps, each pushing its pages (on a fast CPU the
    # one-process prefill may be done before the first poll: the cancel then comes mid-decode).
    until(began, "the prefill never started")
    call.cancel()
    no_blocks_used(prefill, decode)


def _kill_a_rank_mid_transfer(victim: WorkerProcess, prefill: WorkerProcess, decode: WorkerProcess,
                              prompt: list[int], failed: set[grpc.StatusCode], engine: Engine) -> None:
    """Kill `victim`'s other rank mid-transfer (worker_calls.kill_a_rank_mid_transfer)."""
    assert len(victim.tensor_parallel_ranks()) == 1
    _killed.add(victim.proc.pid)

    def expected(prompt: list[int]) -> tuple[list[int], list[float]]:
        ids, margins = _expected(engine, [prompt], LONG)
        return ids[0], margins[0]

    kill_a_rank_mid_transfer(victim, prefill, decode, prompt, LONG, failed, expected)


def test_a_killed_expert_parallel_prefill_rank_leaves_no_block_held_on_the_decode_side(workers, engine):
    prefill = workers["victim_prefill_ep2"]
    _kill_a_rank_mid_transfer(prefill, prefill, workers["decode_tp1"], _prompt(600, 4),
                              {grpc.StatusCode.UNAVAILABLE}, engine)


def test_a_killed_context_parallel_rank_takes_its_idle_worker_down_and_the_decode_side_holds_nothing(workers):
    """A whole prompt splits in one step here, too quick to kill a rank inside: the rank dies while
    its worker idles, which the worker's rank watch notices."""
    prefill, decode = workers["victim_prefill_cp2"], workers["decode_tp1"]
    ranks = prefill.tensor_parallel_ranks()
    assert len(ranks) == 1
    _killed.add(prefill.proc.pid)
    os.kill(ranks[0], signal.SIGKILL)
    assert prefill.proc.wait(DEADLINE_S) == 1, prefill.log_tail()
    with pytest.raises(grpc.RpcError) as failed:
        list(decode_call(decode, prefill, _prompt(300, 9), GREEDY))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    no_blocks_used(decode)


def test_a_killed_expert_parallel_decode_rank_leaves_no_block_held_on_the_prefill_side(workers, engine):
    decode = workers["victim_decode_ep2"]
    _kill_a_rank_mid_transfer(decode, workers["prefill_ep2"], decode, _prompt(600, 5),
                              {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}, engine)


def test_a_killed_pipeline_stage_on_the_prefill_side_leaves_no_block_held_on_the_decode_side(workers, engine):
    prefill = workers["victim_prefill_pp2"]
    _kill_a_rank_mid_transfer(prefill, prefill, workers["decode_tp1"], _prompt(600, 12),
                              {grpc.StatusCode.UNAVAILABLE}, engine)


def test_a_killed_pipeline_stage_on_the_decode_side_leaves_no_block_held_on_the_prefill_side(workers, engine):
    decode = workers["victim_decode_pp2"]
    _kill_a_rank_mid_transfer(decode, workers["prefill_tp1"], decode, _prompt(600, 13),
                              {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}, engine)
