"""Tensor parallelism (engine.parallel): the layout's split of a model, the shards of dense and
integer-group weights, and models split across real processes (gloo) computing what the whole
model computes: the shipped model at 3 ranks, and random models of other shapes at 2 ranks and at
4 ranks with their KV heads replicated (comparing two layouts of the same weights is the point)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from engine.attention.reference import TorchPagedAttention
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.loader import build_model, load_model_files
from engine.model.quantized import QuantizedWeight
from engine.offline import generate
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.shard import columns, rows, shard_tensor, shard_weights
from engine.sampling_params import SamplingParams
from harness.greedy import Checkpoint, greedy, greedy_on_ranks
from tests.reference import check_against
from tests.unit.test_model_hf import save_random_model

pytestmark = pytest.mark.ranks

PROMPT = [1, 504, 3458, 314, 260, 4649, 282, 4760, 30, 378, 1112, 2273, 1597, 28, 357, 2600, 253]


def test_the_shipped_model_splits_at_3_and_9_ranks_and_names_the_numbers_it_cannot(model_files):
    config = model_files.config  # 9 query heads, 3 KV heads, 1,536 intermediate features
    three = [TensorParallelLayout(3, rank) for rank in range(3)]
    assert [list(layout.query_heads(config)) for layout in three] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [list(layout.kv_heads(config)) for layout in three] == [[0], [1], [2]]
    assert [len(layout.intermediate(config)) for layout in three] == [512] * 3
    nine = [TensorParallelLayout(9, rank) for rank in range(9)]
    assert [layout.kv_heads(config).start for layout in nine] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # replicated
    shares = [layout.intermediate(config) for layout in nine]
    assert sum(map(len, shares)) == 1536 and all(len(share) % 32 == 0 for share in shares)
    assert shares[-1].stop == 1536 and all(a.stop == b.start for a, b in itertools.pairwise(shares))
    assert sum(len(layout.vocabulary(config)) for layout in nine) == config.vocab_size
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the 9 query heads, the 3 KV heads"):
        TensorParallelLayout(2, 0).check(config)
    with pytest.raises(ValueError, match="rank: must be in"):
        TensorParallelLayout(3, 3)


def test_integer_groups_split_whole_and_refuse_a_cut_or_an_act_order_by_name():
    q = torch.randint(0, 16, (6, 128), dtype=torch.uint8)
    weight = QuantizedWeight(q=q, scale=torch.rand(6, 4), offset=torch.rand(6, 4), bits=4, group_size=32)
    top = rows("w", weight, range(0, 3))
    assert torch.equal(top.dequantize(), weight.dequantize()[:3])
    right = columns("w", weight, range(64, 128))
    assert torch.equal(right.dequantize(), weight.dequantize()[:, 64:])
    with pytest.raises(ValueError, match=r"w: splitting its 128 input features at 48\.\.128 would cut its groups"):
        columns("w", weight, range(48, 128))
    ordered = QuantizedWeight(q=q.to(torch.int8), scale=torch.rand(6, 4), offset=None, bits=4, group_size=32,
                              perm=torch.randperm(128))
    with pytest.raises(ValueError, match="act-order"):
        columns("model.layers.0.mlp.down_proj.weight", ordered, range(0, 64))


def test_each_rank_holds_a_third_of_the_shipped_models_products(model_files):
    config = model_files.config
    shard = shard_weights(model_files.weights, config, TensorParallelLayout(3, 1))
    name = "model.layers.0."
    assert shard[f"{name}self_attn.q_proj.weight"].shape == (192, 576)
    assert shard[f"{name}self_attn.k_proj.weight"].shape == (64, 576)
    assert shard[f"{name}self_attn.o_proj.weight"].shape == (576, 192)
    assert shard[f"{name}mlp.down_proj.weight"].shape == (576, 512)
    assert shard["model.embed_tokens.weight"].shape == (16384, 576)
    assert torch.equal(shard[f"{name}input_layernorm.weight"], model_files.weights[f"{name}input_layernorm.weight"])


@pytest.mark.parametrize(("quantization", "cpu_weights"), [("none", "fp32"), ("gguf", "plain")])
def test_three_ranks_decode_the_shipped_model_as_one_process_does(quantization, cpu_weights, model_files,
                                                                  tmp_path: Path):
    # "gguf": each rank's products serve its shard of the file's own 4-bit blocks through the kernels.
    whole = greedy(build_model(model_files, TorchPagedAttention(), "cpu", quantization, cpu_weights), PROMPT, 8)
    split = greedy_on_ranks(3, Checkpoint(None, quantization, cpu_weights), PROMPT, 8, str(tmp_path / "rank0.pt"))
    difference = (split.logits - whole.logits).abs().max().item()
    print(f"TP 3, {quantization}: max |logit difference| {difference:.2e}, tokens {split.token_ids}")
    assert difference < 1e-3
    check_against([split.token_ids], [whole.token_ids], [whole.margins], f"shipped model, {quantization}, TP 3")


def _random_checkpoint(directory: Path, heads: int, kv_heads: int) -> Checkpoint:
    save_random_model(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                                  max_position_embeddings=128, initializer_range=0.1), directory)
    return Checkpoint(str(directory))


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(8, 4, 2), (8, 2, 4)])
def test_random_models_split_by_heads_and_with_replicated_kv_heads_decode_as_one_process(
        heads, kv_heads, size, tmp_path: Path):
    checkpoint = _random_checkpoint(tmp_path / "model", heads, kv_heads)
    prompt = [int(t) for t in torch.randint(0, 96, (21,), generator=torch.Generator().manual_seed(2))]
    whole = greedy(build_model(load_model_files(checkpoint.path, torch.float32, "none"), TorchPagedAttention(), "cpu",
                               "none", "fp32"), prompt, 6)
    split = greedy_on_ranks(size, checkpoint, prompt, 6, str(tmp_path / "rank0.pt"))
    assert (split.logits - whole.logits).abs().max().item() < 1e-4
    check_against([split.token_ids], [whole.token_ids], [whole.margins], f"{heads}/{kv_heads} heads at TP {size}")


def _margins(completion) -> list[float]:
    return [top[0][1] - top[1][1] for top in (logprob.top for logprob in completion.logprobs)]


def test_a_three_rank_engine_decodes_a_continuous_batch_as_a_one_process_engine(model_files):
    config = EngineConfig(dtype="float32", quantization="none", cpu_weights="fp32", cache=CacheConfig(num_blocks=48))
    prompts = [PROMPT, [*PROMPT[:9], 42, 43], list(range(100, 160))]
    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2) for tokens in (12, 5, 9)]
    whole = generate(Engine(config, files=model_files), prompts, params)
    engine = Engine(replace(config, tensor_parallel_size=3), files=model_files)
    followers = list(engine._parallel.followers)  # the test checks they are gone after close()
    try:
        split = generate(engine, prompts, params)
        assert engine.stats().num_running == 0
    finally:
        engine.close()
    assert all(not process.is_alive() for process in followers)
    check_against([c.token_ids for c in split], [c.token_ids for c in whole], [_margins(c) for c in whole],
                  "engine at TP 3")


def test_sizes_the_model_cannot_take_are_refused_at_start_up(model_files):
    with pytest.raises(ValueError, match="tensor_parallel_size: must be at least 1, got 0"):
        EngineConfig(role="decode", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the 9 query heads"):
        Engine(EngineConfig(dtype="float32", tensor_parallel_size=2), files=model_files)


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_a_rank_reads_only_its_shard_and_holds_what_sharding_the_whole_model_gives(kind, model_files, tmp_path):
    layout = TensorParallelLayout(3, 1)
    if kind == "gguf":
        path, whole = None, model_files
    else:
        path = str(tmp_path)
        save_random_model(LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False), tmp_path)
        whole = load_model_files(path, torch.float32, "none")
    read = load_model_files(path, torch.float32, "auto" if kind == "gguf" else "none",
                            keep=functools.partial(shard_tensor, layout))
    expected = shard_weights(whole.weights, whole.config, layout)
    assert read.config == whole.config and read.weights.keys() == expected.keys()
    for name, weight in expected.items():
        got = read.weights[name]
        if isinstance(weight, QuantizedWeight):
            assert torch.equal(got.q, weight.q) and torch.equal(got.scale, weight.scale), name
        else:
            assert torch.equal(got, weight), name
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the 9 query heads"):
        load_model_files(None, torch.float32, keep=functools.partial(shard_tensor, TensorParallelLayout(2, 0)))
