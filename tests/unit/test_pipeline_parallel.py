"""Pipeline parallelism (engine.parallel.pipeline): an engine whose layers are split across real stage
processes (gloo) decodes a continuous batch as one process does, its steps cut into micro-batches;
KV pages move between engines of different pipeline layouts both ways (pages of every layer leave
and enter through rank 0). Random models of small shapes built for the test, and the shipped model:
comparing two layouts of the same weights is the point."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from engine.attention.metadata import AttentionMetadata
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.offline import generate
from engine.parallel.pipeline_layout import PipelineLayout, micro_batches
from engine.sampling_params import SamplingParams
from tests.disaggregated import run_disaggregated
from tests.reference import check_against, margins_of
from tests.unit.test_model_hf import VOCAB, random_prompt, save_random_model, save_word_tokenizer

pytestmark = pytest.mark.ranks

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
EXACT = dict(dtype="float32", quantization="none", cpu_weights="fp32")


def test_stages_take_contiguous_layers_the_first_ones_more_and_their_own_tensors(model_files) -> None:
    config = model_files.config  # the shipped model: 30 layers, tied embeddings
    layout = PipelineLayout(4, 0)
    assert [PipelineLayout(4, s).layers(config) for s in range(4)] == [
        range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert layout.stage_of(config, 22) == 2 and layout.budget_layers(config) == 8
    middle, last = PipelineLayout(4, 1), PipelineLayout(4, 3)
    embedding = model_files.weights["model.embed_tokens.weight"]
    assert middle.keep(config, "model.layers.9.mlp.up_proj.weight", embedding) is embedding
    assert middle.keep(config, "model.layers.16.mlp.up_proj.weight", embedding) is None
    assert middle.keep(config, "model.embed_tokens.weight", embedding) is None
    # Tied: the last stage's head is the embedding.
    assert last.keep(config, "model.embed_tokens.weight", embedding) is embedding
    assert last.keep(config, "model.norm.weight", embedding) is embedding
    stage = last.stage_config(config)
    assert (stage.num_layers, stage.first_layer, stage.first_stage, stage.last_stage) == (7, 23, False, True)
    with pytest.raises(ValueError, match="pipeline_parallel_size 31 exceeds the 30 layers of"):
        PipelineLayout(31, 0).check(config)


def _meta(query_lens: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.arange(starts[-1]), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([n + 5 for n in query_lens], dtype=torch.int32),
        block_tables=torch.arange(len(query_lens))[:, None].int(), query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(n + 5 for n in query_lens))


def test_micro_batches_are_whole_sequences_of_about_equal_tokens() -> None:
    meta = _meta([1, 1, 1, 1, 60, 1])
    batches = micro_batches(meta, [0, 1, 2, 3, 63, 64], 2)
    assert [b.rows for b in batches] == [range(0, 64), range(64, 65)]
    assert [b.sample_rows for b in batches] == [[0, 1, 2, 3, 63], [0]]
    assert batches[1].meta.query_start_loc.tolist() == [0, 1] and batches[1].meta.seq_lens_list == (6,)
    even = micro_batches(_meta([1] * 8), list(range(8)), 4)
    assert [b.rows for b in even] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [b.rows for b in micro_batches(_meta([7]), [6], 3)] == [range(0, 7)]  # one sequence: one batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    save_random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  tie_word_embeddings=True, initializer_range=0.1), directory)
    save_word_tokenizer(directory, VOCAB)
    return directory


@pytest.mark.parametrize(("tensor", "stages"), [(1, 3), (2, 2)])
def test_stages_decode_a_continuous_batch_as_one_process(model_dir: Path, tensor: int, stages: int) -> None:
    config = EngineConfig(model=str(model_dir), **EXACT, cache=CacheConfig(num_blocks=48))
    prompts = [random_prompt(n, n) for n in (5, 40, 17, 90)]
    params = [replace(GREEDY, max_tokens=n) for n in (12, 6, 9, 10)]
    whole = generate(Engine(config), prompts, params)
    engine = Engine(replace(config, pipeline_parallel_size=stages, tensor_parallel_size=tensor))
    followers = list(engine._parallel.followers)  # the test checks they are gone after close()
    try:
        split = generate(engine, prompts, params)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        engine.close()
    assert all(not process.is_alive() for process in followers)
    check_against([c.token_ids for c in split], [c.token_ids for c in whole], [margins_of(c) for c in whole],
                  f"engine at TP {tensor} x PP {stages}")
    firsts = [(a.logprobs[0].top[0][1], b.logprobs[0].top[0][1]) for a, b in zip(split, whole, strict=True)]
    assert max(abs(a - b) for a, b in firsts) < 1e-4


@pytest.mark.parametrize(("prefill", "decode"), [((1, 2), (1, 1)), ((1, 1), (1, 3)), ((2, 2), (1, 1)),
                                                ((1, 1), (2, 2))])
def test_pages_move_between_pipeline_layouts_and_decode_as_one_process(model_dir, prefill, decode) -> None:
    """Layouts as (TP, PP): the pages of a TP x PP engine join and split within each stage."""
    config = EngineConfig(model=str(model_dir), **EXACT, cache=CacheConfig(num_blocks=32))
    prompts = [random_prompt(37, 1), random_prompt(70, 2)]
    whole = generate(Engine(config), prompts, GREEDY)
    engines = []
    try:
        for role, (tensor, stages) in (("prefill", prefill), ("decode", decode)):
            engines.append(Engine(replace(config, role=role, tensor_parallel_size=tensor,
                                          pipeline_parallel_size=stages)))
        moved = run_disaggregated(engines[0], engines[1], prompts, GREEDY)
        assert all(e.kv.num_free_blocks == e.kv.num_blocks and not e.scheduler.requests for e in engines)
    finally:
        for engine in engines:
            engine.close()
    check_against(moved, [c.token_ids for c in whole], [margins_of(c) for c in whole],
                  f"prefill TP x PP {prefill} -> decode TP x PP {decode}")


def test_layouts_not_served_are_named() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size: must be at least 1, got 0"):
        EngineConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size: 2 with prefill_context_parallel_size 2"):
        EngineConfig(pipeline_parallel_size=2, prefill_context_parallel_size=2)
