"""LoRA adapters under tensor and pipeline parallelism (engine.parallel.adapter_shard): each rank's
part of an adapter adds the part of the whole LoRA term its part of each product computes (B's rows
of a column-parallel product, A's columns of a row-parallel one, whose partial terms add up to the
whole term once), the same part the base's own split keeps; the shipped base at 3 tensor-parallel
ranks in real processes (gloo), and a random model at 2 pipeline stages of 2 ranks each (its steps
cut into micro-batches), serving batches that mix the base with random adapters of ranks 8 and 16,
greedy as a one-process engine serves them."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import EXACT_FORMATS, check_against
from transformers import LlamaConfig

from engine.config import CacheConfig, EngineConfig, LoraConfig
from engine.engine import Engine
from engine.lora.adapter import MODULES, AdapterError, LoraWeights, projection_shape
from engine.model.loader import load_model_files
from engine.offline import generate
from engine.parallel.adapter_shard import adapter_shard, shard_adapter
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.shard import shard_tensor
from engine.sampling_params import SamplingParams
from harness.lora_adapters import save_adapter
from tests.unit.test_model_hf import VOCAB, random_prompt, save_random_model, save_word_tokenizer

pytestmark = pytest.mark.ranks

ROW_PARALLEL = ("o_proj", "down_proj")


def _random_adapter(config, rank: int) -> dict[tuple[int, str], LoraWeights]:
    generator = torch.Generator().manual_seed(rank)
    weights = {}
    for module in MODULES:
        out, inp = projection_shape(config, module)
        weights[(0, module)] = LoraWeights(torch.randn(rank, inp, generator=generator),
                                           torch.randn(out, rank, generator=generator))
    return weights


@pytest.mark.parametrize("size", [3, 9])  # 9: each of the 3 KV heads replicated on 3 ranks
def test_each_ranks_part_adds_its_part_of_the_whole_term_as_the_base_splits(model_files, size):
    config = model_files.config  # 9 query heads of 64, 3 KV heads, 1,536 intermediate features
    weights = _random_adapter(config, 8)
    x = torch.randn(5, max(config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size),
                    generator=torch.Generator().manual_seed(1))
    parts = [shard_adapter(TensorParallelLayout(size, rank), config, weights) for rank in range(size)]
    for module in MODULES:
        whole = weights[(0, module)]
        full = x[:, :whole.a.shape[1]] @ whole.a.T @ whole.b.T
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.0.{block}.{module}.weight"
        if module in ROW_PARALLEL:
            # A keeps the rank's input columns, B is whole: the partial terms add up to the whole term once.
            starts = [0]
            for part in parts:
                assert torch.equal(part[(0, module)].b, whole.b)
                starts.append(starts[-1] + part[(0, module)].a.shape[1])
            assert starts[-1] == whole.a.shape[1]
            partial = [x[:, a:b] @ part[(0, module)].a.T @ part[(0, module)].b.T
                       for part, a, b in zip(parts, starts, starts[1:], strict=False)]
            torch.testing.assert_close(sum(partial), full, rtol=1e-4, atol=1e-3)
        else:
            # B keeps the rows of the output the rank computes, A is whole.
            outputs = [x[:, :whole.a.shape[1]] @ part[(0, module)].a.T @ part[(0, module)].b.T for part in parts]
            assert all(torch.equal(part[(0, module)].a, whole.a) for part in parts)
            if size == 3 or module in ("q_proj", "gate_proj", "up_proj"):
                torch.testing.assert_close(torch.cat(outputs, dim=1), full)
            else:  # ranks 3h..3h+2 each hold KV head h whole
                for rank, output in enumerate(outputs):
                    head = rank // 3
                    torch.testing.assert_close(output, full[:, head * 64:(head + 1) * 64])
        # The same part as the base's split of the projection the term adds to: B·A is split as W is.
        for rank, part in enumerate(parts):
            delta = whole.b @ whole.a
            torch.testing.assert_close(part[(0, module)].b @ part[(0, module)].a,
                                       shard_tensor(TensorParallelLayout(size, rank), config, name, delta))
    assert adapter_shard(TensorParallelLayout(1, 0), config) is None  # one rank keeps every adapter whole


ADAPTERS = {"rank8-a": (8, 1), "rank16": (16, 2), "rank8-b": (8, 3)}  # name: (rank, seed)
PROMPTS = [[1, 504, 3458, 314, 260, 4649, 282], [1, 4760, 30, 378, 1112, 2273], [1, 1597, 28, 357, 2600, 253, 42],
           [1, 100, 101, 102, 103]]
MAX_TOKENS = 6


def _greedy(name: str) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2, lora_name=name)


def _margins(completion) -> list[float]:
    return [top[0][1] - top[1][1] for top in (logprob.top for logprob in completion.logprobs)]


def _split_as_one_process(config: EngineConfig, sizes: dict[str, int], prompts: list[list[int]],
                          files=None) -> None:
    """`config`'s engine split by `sizes` decodes `prompts` under the base and each adapter (one
    batch, two slots for three adapters: the third waits for one and is loaded into it mid-run, on
    every rank) as the one-process engine does."""
    params = [_greedy(name) for name in ["", *ADAPTERS]]
    one = Engine(config, files=files)
    whole = generate(one, prompts, params)
    base = generate(one, prompts[1:], _greedy(""))
    engine = Engine(replace(config, **sizes), files=files)
    try:
        split = generate(engine, prompts, params)
        assert engine.stats().num_running == 0
    finally:
        engine.close()
    check_against([c.token_ids for c in split], [c.token_ids for c in whole], [_margins(c) for c in whole],
                  f"LoRA at {sizes}")
    # Every adapter changes what the base computes (the comparison could not fail otherwise).
    assert all(b.token_ids != w.token_ids for b, w in zip(base, whole[1:], strict=True))


def _lora(directory: Path, model) -> LoraConfig:
    modules = tuple((name, str(save_adapter(directory / name, model, rank, seed)))
                    for name, (rank, seed) in ADAPTERS.items())
    return LoraConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=3, modules=modules)


def test_a_three_rank_engine_serves_the_base_and_adapters_in_one_batch_as_one_process(model_files, tmp_path: Path):
    config = EngineConfig(**EXACT_FORMATS, cache=CacheConfig(num_blocks=48, enable_prefix_caching=False),
                          lora=_lora(tmp_path, model_files.config))
    _split_as_one_process(config, {"tensor_parallel_size": 3}, PROMPTS, model_files)


def test_pipeline_stages_of_two_ranks_serve_the_base_and_adapters_in_micro_batches_as_one_process(tmp_path: Path):
    directory = tmp_path / "llama"
    save_random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  tie_word_embeddings=True, initializer_range=0.1), directory)
    save_word_tokenizer(directory, VOCAB)
    model = load_model_files(str(directory), torch.float32, "none").config
    config = EngineConfig(model=str(directory), **EXACT_FORMATS, cache=CacheConfig(num_blocks=48),
                          lora=_lora(tmp_path, model))
    prompts = [random_prompt(n, n) for n in (5, 40, 17, 30)]  # micro-batches mixing the base and adapters
    _split_as_one_process(config, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, prompts)


def test_a_start_up_adapter_not_served_stops_the_other_ranks_with_rank_0(model_files, tmp_path: Path):
    config = EngineConfig(**EXACT_FORMATS, tensor_parallel_size=3, cache=CacheConfig(num_blocks=16),
                          lora=LoraConfig(modules=(("missing", str(tmp_path / "missing")),)))
    with pytest.raises(AdapterError, match=r"'missing'.*not a directory"):
        Engine(config, files=model_files)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tensor-parallel-rank")]
