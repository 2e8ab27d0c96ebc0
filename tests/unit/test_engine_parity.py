"""Greedy output of the engine vs transformers on the same dequantized weights, and batch
invariance of the engine across batch shapes, chunking, prefix caching and preemption."""

from __future__ import annotations

import functools

import pytest
from parity_prompts import parity_prompt_ids
from reference import EXACT_FORMATS, check_against, reference_greedy

from engine.config import CacheConfig, SchedulerConfig
from engine.offline import generate
from engine.sampling_params import SamplingParams

MAX_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def make_engine(make_engine):
    """Engines in exact fp32 (`--dtype float32 --quantization none`), as transformers computes."""
    return functools.partial(make_engine, **EXACT_FORMATS)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = parity_prompt_ids(tokenizer)
    assert max(len(p) for p in ids) >= 1000, "one parity prompt must be about 1,000 tokens"
    return ids


@pytest.fixture(scope="module")
def alone(make_engine, prompts):
    """Each prompt alone on a fresh cache: the baseline for the batch-invariance checks."""
    engine = make_engine(cache=CacheConfig(enable_prefix_caching=False))
    runs = [generate(engine, [p], GREEDY)[0] for p in prompts]
    margins = [[lp.top[0][1] - lp.top[1][1] for lp in run.logprobs] for run in runs]
    return [run.token_ids for run in runs], margins


def test_greedy_matches_transformers(reference_model, prompts, alone):
    references = [reference_greedy(reference_model, p, MAX_TOKENS) for p in prompts]
    ours, _ = alone
    check_against(ours, [r.token_ids for r in references], [r.margins for r in references], "vs transformers")


def _others(tokenizer) -> list[list[int]]:
    texts = [
        "Once upon a time",
        "The three primary colours are",
        "import numpy as np\nx = np.arange(10)\n",
        "A short list of prime numbers: 2, 3, 5,",
        "Water boils at",
        "In 1969, the first humans",
        "The quick brown fox " * 20,
        "Dear Sir or Madam, I am writing to",
    ]
    return [tokenizer.encode(t) for t in texts]


def _check_batch(make_engine, prompts, alone, label, extra=(), **engine_kwargs):
    engine = make_engine(**engine_kwargs)
    runs = generate(engine, list(prompts) + list(extra), GREEDY)
    ours = [run.token_ids for run in runs[: len(prompts)]]
    check_against(ours, alone[0], alone[1], label)
    return engine, runs


def test_mixed_batch_of_16(make_engine, prompts, alone, tokenizer):
    _check_batch(make_engine, prompts, alone, "mixed batch of 16", extra=_others(tokenizer))


def test_chunked_prefill_small_budget(make_engine, prompts, alone):
    _check_batch(make_engine, prompts, alone, "chunked prefill", scheduler=SchedulerConfig(max_num_batched_tokens=48))


def test_prefix_cache_hits(make_engine, prompts, alone):
    engine = make_engine()
    generate(engine, prompts, GREEDY)  # fills the prefix cache
    runs = generate(engine, prompts, GREEDY)
    assert all(run.num_cached_tokens > 0 for run in runs if len(run.prompt_token_ids) > 16)
    assert runs[3].num_cached_tokens >= 1000
    check_against([run.token_ids for run in runs], alone[0], alone[1], "prefix-cache hits")


def test_preemption_under_small_kv_pool(make_engine, prompts, alone):
    # 90 blocks of 16 tokens hold the longest request (~1,140 tokens) but not all eight at once.
    engine, _ = _check_batch(
        make_engine, prompts, alone, "small KV pool", cache=CacheConfig(num_blocks=90, memory_bytes=None)
    )
    assert engine.scheduler.total_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
