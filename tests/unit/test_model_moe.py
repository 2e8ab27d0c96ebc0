"""Mixture-of-experts models (engine.model.moe) against transformers' own Mixtral, Qwen2-MoE and
Qwen3-MoE classes on the same random weights (small shapes built for the test: comparing two code
paths is the point), the grouped forward against a per-expert reference, the formats it is served
in, and the variants and layouts refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from engine.attention.reference import TorchPagedAttention
from engine.config import CacheConfig, EngineConfig, MoEConfig
from engine.engine import Engine
from engine.model.hf_loader import config_from_hf
from engine.model.loader import build_model, load_model_files
from engine.model.moe import Expert, ExpertLoop, SparseMoE
from engine.model.quantized_linear import QuantizedLinear
from engine.offline import generate
from engine.parallel.layout import TensorParallelLayout
from engine.sampling_params import SamplingParams
from tests.reference import check_against, reference_greedy
from tests.unit.test_model_hf import VOCAB, run_chunks, save_random_model, save_word_tokenizer

_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.1)
MOE_CONFIGS = {
    "mixtral": lambda: MixtralConfig(**_SHAPE, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                                     sliding_window=None),
    "qwen2_moe_shared": lambda: Qwen2MoeConfig(**_SHAPE, intermediate_size=64, moe_intermediate_size=64,
                                               shared_expert_intermediate_size=128, num_experts=8,
                                               num_experts_per_tok=2),
    "qwen3_moe_qk_norm": lambda: Qwen3MoeConfig(**_SHAPE, intermediate_size=64, moe_intermediate_size=64,
                                                num_experts=8, num_experts_per_tok=2, head_dim=16,
                                                norm_topk_prob=True),
}
CONFIGS: dict[str, object] = {**MOE_CONFIGS, "qwen3_qk_norm": lambda: Qwen3Config(**_SHAPE, intermediate_size=64,
                                                                                    head_dim=16)}
EXACT = dict(dtype="float32", quantization="none", cpu_weights="fp32")


def save_moe(variant: str, directory: Path) -> torch.nn.Module:
    """A random model of `variant` saved with a word tokenizer (an engine can serve it); transformers' copy."""
    hf_config: PretrainedConfig = CONFIGS[variant]()  # type: ignore[operator]
    reference = save_random_model(hf_config, directory)
    save_word_tokenizer(directory, VOCAB)
    return reference


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_logits_match_transformers_in_one_prefill_and_in_chunks(variant: str, tmp_path: Path) -> None:
    reference = save_moe(variant, tmp_path)
    files = load_model_files(str(tmp_path), torch.float32)
    assert files.config.architecture == type(reference).__name__
    model = build_model(files, TorchPagedAttention(), "cpu", cpu_weights="fp32")
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(tokens[None, :]).logits[0].float()
    assert (run_chunks(model, tokens, [40]) - expected).abs().max().item() < 1e-4
    assert (run_chunks(model, tokens, [30, 31, 40]) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", sorted(MOE_CONFIGS))
def test_a_continuous_batch_decodes_greedily_as_transformers_does(variant: str, tmp_path: Path) -> None:
    reference = save_moe(variant, tmp_path)
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 23, 40)]
    runs = [reference_greedy(reference, prompt, 10) for prompt in prompts]
    engine = Engine(EngineConfig(model=str(tmp_path), **EXACT, cache=CacheConfig(num_blocks=32)))
    completions = generate(engine, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    check_against([c.token_ids for c in completions], [r.token_ids for r in runs], [r.margins for r in runs],
                  f"{variant} in a continuous batch")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def _naive_moe(config: MoEConfig, x: torch.Tensor, router: torch.Tensor,
               experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Token by token, expert by expert: the definition."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        probs = torch.softmax(x[row] @ router.T, -1)
        top, ids = torch.topk(probs, config.top_k)
        if config.normalize_top_k:
            top = top / top.sum()
        for weight, expert in zip(top, ids.tolist(), strict=True):
            gate, up, down = experts[expert]
            out[row] += weight * ((torch.nn.functional.silu(x[row] @ gate.T) * (x[row] @ up.T)) @ down.T)
    return out


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_grouped_forward_is_the_per_token_definition_and_a_shard_its_experts_share(rows, normalize) -> None:
    torch.manual_seed(rows)
    hidden, inter, count = 32, 16, 6
    config = MoEConfig(num_experts=count, top_k=2, intermediate_size=inter, normalize_top_k=normalize)
    router = torch.randn(count, hidden)
    weights = [(torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter))
               for _ in range(count)]

    def moe(held: range) -> SparseMoE:
        experts = ExpertLoop({
            e: Expert(lambda x, g=weights[e][0], u=weights[e][1]: torch.cat((x @ g.T, x @ u.T), -1),
                      lambda x, d=weights[e][2]: x @ d.T,
                      lambda gu: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:])
            for e in held})
        return SparseMoE(replace(config, experts_held=(held.start, held.stop)), lambda x: x @ router.T, experts)

    x = torch.randn(rows, hidden)
    expected = _naive_moe(config, x, router, weights)
    assert torch.allclose(moe(range(count))(x), expected, atol=1e-3, rtol=1e-4)
    # Two shards' partial sums (what expert parallelism all-reduces) make the whole.
    assert torch.allclose(moe(range(0, 2))(x) + moe(range(2, count))(x), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("formats", [{"quantization": "int8"}, {"dtype": torch.bfloat16}])
def test_int8_and_bf16_experts_track_fp32(formats: dict, tmp_path: Path) -> None:
    """The formats other than exact fp32 serve the experts through the engine's products (int8 per
    channel through the kernels' QuantizedLinear) and stay close to fp32's logits; a row whose
    routing flips between two near-equal experts may differ more, so the bound is on the mean."""
    save_moe("mixtral", tmp_path)
    files = load_model_files(str(tmp_path), torch.float32)
    tokens = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    exact = run_chunks(build_model(files, TorchPagedAttention(), "cpu", cpu_weights="fp32"), tokens, [24])
    model = build_model(files, TorchPagedAttention(), "cpu", **formats)
    moe = model.layers[0].moe
    assert isinstance(moe, SparseMoE)
    if formats.get("quantization") == "int8":
        assert isinstance(moe.experts, ExpertLoop) and isinstance(moe.experts.experts[0].gate_up, QuantizedLinear)
    logits = run_chunks(model, tokens, [24]).float()
    assert (logits - exact).abs().mean().item() < 0.05 * exact.abs().mean().item()
    assert (logits.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize(("raw", "fragment"), [
    ({"architectures": ["Qwen2MoeForCausalLM"], "mlp_only_layers": [1]}, "mlp_only_layers: unsupported"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 2}, "decoder_sparse_step: unsupported"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "unsupported architectures \\['DeepseekV3ForCausalLM'\\]"),
    ({"architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 9}, "num_experts_per_tok: must be in"),
])
def test_variants_not_served_are_named(raw: dict, fragment: str) -> None:
    base = {**_SHAPE, "intermediate_size": 64, "moe_intermediate_size": 64, "num_experts": 8,
            "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match=fragment):
        config_from_hf({**base, **raw})


def test_layouts_the_model_cannot_take_name_the_numbers(tmp_path: Path) -> None:
    save_moe("qwen2_moe_shared", tmp_path)
    config = load_model_files(str(tmp_path), torch.float32).config
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*the 8 experts"):
        TensorParallelLayout(3, 0, expert_parallel=True).check(config)
    with pytest.raises(ValueError, match="the 64 intermediate features of each expert into groups of 32"):
        TensorParallelLayout(4, 0).check(config)
    with pytest.raises(ValueError, match="the 128 intermediate features of the shared expert"):
        TensorParallelLayout(8, 0, expert_parallel=True).check(config)
    dense = replace(config, moe=None, architecture="LlamaForCausalLM", name="dense")
    with pytest.raises(ValueError, match="enable_expert_parallel: dense \\(LlamaForCausalLM\\) is a dense model"):
        TensorParallelLayout(1, 0, expert_parallel=True).check(dense)
    assert TensorParallelLayout(2, 1, expert_parallel=True).shard_config(config).moe.held == range(4, 8)


def test_an_moe_model_speculates_and_takes_an_int8_kv_cache_like_any_model(tmp_path: Path) -> None:
    """n-gram speculation keeps greedy tokens exact (verification is the target's own argmax); an int8
    KV cache is another format, judged by its greedy agreement with the exact one."""
    from engine.compose import build_engine
    from engine.speculative.config import SpeculativeConfig

    save_moe("qwen3_moe_qk_norm", tmp_path)
    # Repetitive prompts, so prompt lookup proposes drafts.
    prompts = [[5, 6, 7, 8] * 6, [int(t) for t in torch.randint(0, VOCAB, (30,), generator=torch.Generator())]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(tmp_path), **EXACT, cache=CacheConfig(num_blocks=32))
    plain = [c.token_ids for c in generate(Engine(config), prompts, params)]
    speculative = build_engine(replace(config, speculative=SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=None, gate="off")))
    assert [c.token_ids for c in generate(speculative, prompts, params)] == plain
    assert speculative.scheduler.spec_stats.num_accepted_tokens > 0
    int8_kv = [c.token_ids for c in generate(Engine(replace(config, kv_cache_dtype="int8")), prompts, params)]
    # A random model's logits are close everywhere, so a greedy run parts where rounding moves one;
    # each prompt's first token (its logits read every prompt page in int8) agrees.
    assert [ours[0] for ours in int8_kv] == [exact[0] for exact in plain]
