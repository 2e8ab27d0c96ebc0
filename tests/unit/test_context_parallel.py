"""Prefill context parallelism (engine.parallel.context_parallel): a long fresh prompt's prefill split
across real processes (gloo) by sequence computes what one process computes, its pages landing in
rank 0's cache (decoded there, or exported to a decode engine of another layout); prompts below the
threshold, with a cached prefix or in company run on rank 0 alone. Random models of small shapes
built for the test: comparing two layouts of the same weights is the point."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from transformers import LlamaConfig

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.offline import generate
from engine.parallel.context_parallel import split
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput
from tests.disaggregated import run_disaggregated
from tests.reference import check_against, margins_of
from tests.unit.test_model_hf import VOCAB, random_prompt, save_random_model, save_word_tokenizer

pytestmark = pytest.mark.ranks

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
EXACT = dict(dtype="float32", quantization="none", cpu_weights="fp32")


def _out(*chunks: tuple[int, int, int]) -> SchedulerOutput:
    """A step of chunks (known tokens, start, tokens computed)."""
    params = SamplingParams(max_tokens=4)
    return SchedulerOutput(chunks=[
        ScheduledChunk(Request(f"r{i}", list(range(known)), params, 4096), start, count, (0,))
        for i, (known, start, count) in enumerate(chunks)])


def test_only_a_step_of_one_whole_fresh_prompt_over_the_threshold_splits() -> None:
    assert split(_out((100, 0, 100)), 2, 64, 0.0) == [0, 50, 100]
    assert split(_out((101, 0, 101)), 3, 64, 0.0) == [0, 34, 67, 101]
    assert split(_out((100, 0, 100)), 1, 64, 0.0) is None  # one rank
    assert split(_out((63, 0, 63)), 2, 64, 0.0) is None  # below the threshold
    assert split(_out((100, 16, 84)), 2, 64, 0.0) is None  # a cached prefix: its pages are rank 0's alone
    assert split(_out((200, 0, 100)), 2, 64, 0.0) is None  # a chunk of a longer prompt
    assert split(_out((100, 0, 100), (40, 39, 1)), 2, 64, 0.0) is None  # in company


def test_slices_are_cut_for_equal_work_the_first_longer_where_attention_counts() -> None:
    ratio = 0.01  # a query-key pair costs a hundredth of a token's products
    bounds = split(_out((1000, 0, 1000)), 2, 64, ratio)
    assert bounds is not None and bounds[0] == 0 and bounds[2] == 1000 and 600 < bounds[1] < 800

    def work(start: int, end: int) -> float:
        return (end - start) + ratio * (end * end - start * start) / 2

    assert abs(work(0, bounds[1]) - work(bounds[1], 1000)) < 0.01 * work(0, 1000)
    assert split(_out((5, 0, 5)), 4, 2, 10.0) == [0, 2, 3, 4, 5]  # every rank keeps a token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    save_random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  initializer_range=0.1), directory)
    save_word_tokenizer(directory, VOCAB)
    return directory


def _config(model_dir: Path, **fields) -> EngineConfig:
    return EngineConfig(model=str(model_dir), **EXACT, cache=CacheConfig(num_blocks=64),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512), **fields)


def _spied(engine: Engine) -> list[list[int]]:
    """The bounds of every split step the engine runs from now on."""
    context = engine.runner._context
    assert context is not None
    seen: list[list[int]] = []
    run = context.run

    def spy(input_ids, bounds, *args):
        seen.append(bounds)
        return run(input_ids, bounds, *args)

    context.run = spy  # type: ignore[method-assign]
    return seen


def test_split_prompts_decode_as_one_process_and_short_or_cached_ones_run_on_rank_0(model_dir: Path) -> None:
    config = _config(model_dir, prefill_context_parallel_min_tokens=64)
    long, other = random_prompt(301, 1), random_prompt(90, 2)
    prompts = [long, other, random_prompt(20, 3), long[:200] + random_prompt(70, 4)]  # the last hits long's prefix
    whole = [generate(Engine(config), [prompt], GREEDY)[0] for prompt in prompts]
    engine = Engine(replace(config, prefill_context_parallel_size=3))
    try:
        splits = _spied(engine)
        # One at a time, so that each prompt's step is its own.
        ours = [generate(engine, [prompt], GREEDY)[0] for prompt in prompts]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        engine.close()
    # The long prompt and the 90-token one split (three slices each, the first the longest); the
    # others ran on rank 0.
    assert [(b[0], b[-1], len(b)) for b in splits] == [(0, 301, 4), (0, 90, 4)]
    assert all(b[1] - b[0] >= b[2] - b[1] >= b[3] - b[2] for b in splits)
    check_against([c.token_ids for c in ours], [c.token_ids for c in whole], [margins_of(c) for c in whole],
                  "prefill context parallel 3")
    first = [c.logprobs[0].top[0][1] for c in ours], [c.logprobs[0].top[0][1] for c in whole]
    assert max(abs(a - b) for a, b in zip(*first, strict=True)) < 1e-4


def test_a_split_prefill_exports_its_pages_to_a_decode_engine(model_dir: Path) -> None:
    config = _config(model_dir, prefill_context_parallel_min_tokens=32)
    prompts = [random_prompt(150, 5), random_prompt(77, 6)]
    whole = generate(Engine(config), prompts, GREEDY)
    engines = [Engine(replace(config, role="prefill", prefill_context_parallel_size=2)),
               Engine(replace(config, role="decode"))]
    try:
        splits = _spied(engines[0])
        moved = run_disaggregated(engines[0], engines[1], prompts, GREEDY)
        assert all(e.kv.num_free_blocks == e.kv.num_blocks and not e.scheduler.requests for e in engines)
    finally:
        for engine in engines:
            engine.close()
    assert len(splits) == 2
    check_against(moved, [c.token_ids for c in whole], [margins_of(c) for c in whole],
                  "prefill context parallel 2 -> decode")


def test_layouts_not_served_are_named() -> None:
    with pytest.raises(ValueError, match="prefill_context_parallel_size: must be at least 1, got 0"):
        EngineConfig(prefill_context_parallel_size=0)
    with pytest.raises(ValueError, match="prefill_context_parallel_size: 2 with tensor_parallel_size 2 is not served"):
        EngineConfig(prefill_context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_context_parallel_min_tokens: must be at least 2"):
        EngineConfig(prefill_context_parallel_min_tokens=1)
