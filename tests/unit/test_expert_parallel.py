"""Mixtures of experts split across real processes (gloo): whole experts per rank (expert
parallelism) or every expert's features per rank (tensor parallelism) compute what one process
computes; engines of different expert layouts exchange KV pages (the pages are attention's: the
expert layout is no part of them). Random models of small shapes built for the test: comparing
two layouts of the same weights is the point."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.attention.reference import TorchPagedAttention
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.loader import build_model, load_model_files
from engine.model.moe import ExpertLoop, SparseMoE
from engine.offline import generate
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.shard import shard_tensor
from engine.sampling_params import SamplingParams
from harness.greedy import Checkpoint, greedy, greedy_on_ranks
from tests.disaggregated import run_disaggregated
from tests.reference import check_against, margins_of
from tests.unit.test_model_hf import random_prompt
from tests.unit.test_model_moe import EXACT, save_moe

pytestmark = pytest.mark.ranks

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def test_a_rank_reads_only_its_experts(tmp_path: Path) -> None:
    save_moe("qwen2_moe_shared", tmp_path)
    whole = load_model_files(str(tmp_path), torch.float32)
    layout = TensorParallelLayout(4, 3, expert_parallel=True)
    files = load_model_files(str(tmp_path), torch.float32, keep=lambda c, n, w: shard_tensor(layout, c, n, w))
    experts = {name.split(".")[5] for name in files.weights if ".experts." in name}
    assert experts == {"6", "7"}
    # The router and the shared expert's gate are whole; the shared expert is a quarter of its features.
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(files.weights[router], whole.weights[router])
    assert files.weights["model.layers.0.mlp.shared_expert.up_proj.weight"].shape == (32, 64)
    assert files.weights["model.layers.0.mlp.shared_expert.down_proj.weight"].shape == (64, 32)
    model = build_model(replace(files, config=layout.shard_config(whole.config)), TorchPagedAttention(), "cpu")
    moe = model.layers[1].moe
    assert isinstance(moe, SparseMoE) and isinstance(moe.experts, ExpertLoop) and sorted(moe.experts.experts) == [6, 7]


@pytest.mark.parametrize(("variant", "size", "expert_parallel"), [
    ("mixtral", 2, True), ("qwen2_moe_shared", 4, True), ("qwen3_moe_qk_norm", 2, False)])
def test_expert_and_tensor_parallel_ranks_decode_as_one_process(variant, size, expert_parallel, tmp_path: Path):
    save_moe(variant, tmp_path / "model")
    checkpoint = Checkpoint(str(tmp_path / "model"), expert_parallel=expert_parallel)
    prompt = random_prompt(21, 21)
    whole = greedy(build_model(load_model_files(checkpoint.path, torch.float32, "none"), TorchPagedAttention(), "cpu",
                               "none", "fp32"), prompt, 6)
    split = greedy_on_ranks(size, checkpoint, prompt, 6, str(tmp_path / "rank0.pt"))
    assert (split.logits - whole.logits).abs().max().item() < 1e-4
    check_against([split.token_ids], [whole.token_ids], [whole.margins],
                  f"{variant} at {'EP' if expert_parallel else 'TP'} {size}")


def test_engines_of_different_expert_layouts_exchange_kv_and_hold_nothing_after(tmp_path: Path) -> None:
    save_moe("mixtral", tmp_path)
    config = EngineConfig(model=str(tmp_path), **EXACT, cache=CacheConfig(num_blocks=24))
    prompts = [random_prompt(17, 17), random_prompt(40, 40)]
    whole = generate(Engine(config), prompts, GREEDY)
    engines = []
    try:
        # Prefill: experts split whole over 2 ranks; decode: one process holding every expert.
        for layout in (replace(config, role="prefill", tensor_parallel_size=2, enable_expert_parallel=True),
                       replace(config, role="decode")):
            engines.append(Engine(layout))
        prefill, decode = engines
        moved = run_disaggregated(prefill, decode, prompts, GREEDY)
        assert all(e.kv.num_free_blocks == e.kv.num_blocks and not e.scheduler.requests for e in engines)
    finally:
        for engine in engines:
            engine.close()
    check_against(moved, [c.token_ids for c in whole], [margins_of(c) for c in whole], "prefill EP 2 -> decode EP 1")


def test_pipeline_stages_of_expert_parallel_ranks_decode_as_one_process(tmp_path: Path) -> None:
    save_moe("qwen2_moe_shared", tmp_path)
    config = EngineConfig(model=str(tmp_path), **EXACT, cache=CacheConfig(num_blocks=24))
    prompts = [random_prompt(9, 9), random_prompt(33, 33), random_prompt(20, 20)]
    whole = generate(Engine(config), prompts, GREEDY)
    engine = Engine(replace(config, tensor_parallel_size=2, enable_expert_parallel=True, pipeline_parallel_size=2))
    try:
        split = generate(engine, prompts, GREEDY)
    finally:
        engine.close()
    check_against([c.token_ids for c in split], [c.token_ids for c in whole], [margins_of(c) for c in whole],
                  "EP 2 x PP 2")
