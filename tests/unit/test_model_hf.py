"""LlamaForCausalLM on tiny random HF checkpoints matches transformers' own forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import TorchPagedAttention
from engine.model.hf_loader import config_from_hf
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import build_model, load_model_files
from engine.model.weight_formats import WeightFormat

BLOCK_SIZE = 16
NUM_BLOCKS = 8
VOCAB = 96

_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1,
)
CONFIGS = {
    "llama_gqa_tied": lambda: LlamaConfig(**_SHAPE, tie_word_embeddings=True, rope_theta=5000.0),
    "llama3_scaling": lambda: LlamaConfig(**_SHAPE, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0}),
    "linear_scaling": lambda: LlamaConfig(**_SHAPE, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic_scaling": lambda: LlamaConfig(**_SHAPE, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "qwen2_bias": lambda: Qwen2Config(**_SHAPE),
    "mistral_head_dim": lambda: MistralConfig(**{**_SHAPE, "num_key_value_heads": 1}, head_dim=24, sliding_window=None),
}


def save_random_model(hf_config: PretrainedConfig, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Random init leaves biases and norm weights at trivial values; perturb them so they are exercised.
        for name, param in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(directory)
    return reference


def save_word_tokenizer(directory: Path, vocab: int) -> None:
    """A tokenizer.json of `vocab` words "t0".."t{vocab-1}", so an engine can serve a random model."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    backend = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))


def random_prompt(length: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """`length` token ids below `vocab`, the same for the same seed."""
    return [int(t) for t in torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))]


def single_sequence_meta(start: int, end: int) -> AttentionMetadata:
    """Metadata for tokens [start, end) of one sequence laid out over blocks 7, 6, 5, ... (not in order)."""
    block_table = torch.arange(NUM_BLOCKS - 1, -1, -1, dtype=torch.int32)
    positions = torch.arange(start, end)
    slots = block_table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=block_table[None, :],
        query_lens_list=(end - start,),
        seq_lens_list=(end,),
    )


def run_chunks(model: LlamaForCausalLM, tokens: torch.Tensor, chunk_ends: list[int]) -> torch.Tensor:
    """Logits for every token, computed in consecutive chunks that reuse the paged KV cache."""
    config = model.config
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    logits, start = [], 0
    with torch.inference_mode():
        for end in chunk_ends:
            hidden = model(tokens[start:end], torch.arange(start, end), kv_caches, single_sequence_meta(start, end))
            logits.append(model.compute_logits(hidden))
            start = end
    return torch.cat(logits)


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_logits_match_transformers(variant: str, tmp_path: Path) -> None:
    reference = save_random_model(CONFIGS[variant](), tmp_path)
    model = build_model(load_model_files(str(tmp_path), torch.float32), TorchPagedAttention(), "cpu")
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(tokens[None, :]).logits[0].float()

    prefill = run_chunks(model, tokens, [40])
    chunked = run_chunks(model, tokens, [30, 40])

    assert prefill.dtype == torch.float32 and prefill.shape == (40, VOCAB)
    assert (prefill - expected).abs().max().item() < 1e-4
    assert (chunked - expected).abs().max().item() < 1e-4


def test_layer_callback_runs_once_per_layer_in_order(tmp_path: Path) -> None:
    save_random_model(CONFIGS["llama_gqa_tied"](), tmp_path)
    model = build_model(load_model_files(str(tmp_path), torch.float32), TorchPagedAttention(), "cpu")
    shape = (NUM_BLOCKS, BLOCK_SIZE, model.config.num_kv_heads, model.config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.config.num_layers)]
    done: list[int] = []

    def record(layer: int) -> None:
        # The layer's K/V must already be in its cache when the callback fires.
        assert kv_caches[layer][0].abs().sum() > 0
        done.append(layer)

    with torch.inference_mode():
        model(torch.arange(5), torch.arange(5), kv_caches, single_sequence_meta(0, 5), on_layer_done=record)
    assert done == list(range(model.config.num_layers))


def test_config_fields_from_hf(tmp_path: Path) -> None:
    save_random_model(CONFIGS["llama3_scaling"](), tmp_path)
    config = load_model_files(str(tmp_path), torch.float32).config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.rope_theta == 500000.0 and not config.tie_word_embeddings
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.original_max_position_embeddings == 32


def test_legacy_rope_scaling_and_eos_list() -> None:
    raw = {"architectures": ["LlamaForCausalLM"], **_SHAPE, "rope_theta": 1234.0,
           "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [5, 7], "bos_token_id": 1}
    config = config_from_hf(raw)
    assert config.rope_theta == 1234.0 and config.eos_token_ids == (5, 7) and config.bos_token_id == 1
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "linear"
    assert config.rope_scaling.factor == 2.0


@pytest.mark.parametrize("extra, fragment", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_config_raises(extra: dict[str, object], fragment: str) -> None:
    raw = {"architectures": ["MistralForCausalLM"], **_SHAPE, **extra}
    with pytest.raises(ValueError, match=fragment):
        config_from_hf(raw)


def test_sliding_window_covering_the_context_is_accepted() -> None:
    raw = {"architectures": ["MistralForCausalLM"], **_SHAPE, "sliding_window": _SHAPE["max_position_embeddings"]}
    assert config_from_hf(raw).num_layers == 2


def test_missing_and_misshaped_tensors_are_named(tmp_path: Path) -> None:
    save_random_model(CONFIGS["llama_gqa_tied"](), tmp_path)
    files = load_model_files(str(tmp_path), torch.float32)
    model = LlamaForCausalLM(files.config, TorchPagedAttention())
    weights = dict(files.weights)
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.norm.weight"] = torch.ones(3)
    weights["model.extra.weight"] = torch.ones(1)
    with pytest.raises(ValueError) as error:
        model.load_weights(weights, WeightFormat("none", torch.float32))
    message = str(error.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "model.norm.weight (expected (64,), got (3,))" in message
    assert "unexpected: model.extra.weight" in message


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    reference = save_random_model(CONFIGS["qwen2_bias"](), tmp_path / "single")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    single = load_model_files(str(tmp_path / "single"), torch.float32).weights
    sharded = load_model_files(str(tmp_path / "sharded"), torch.bfloat16).weights
    assert single.keys() == sharded.keys()
    assert all(sharded[name].dtype == torch.bfloat16 for name in sharded)
    assert all(torch.equal(single[name].bfloat16(), sharded[name]) for name in single)


def test_bfloat16_weights_run_in_bfloat16(tmp_path: Path) -> None:
    reference = save_random_model(CONFIGS["llama3_scaling"](), tmp_path)
    model = build_model(load_model_files(str(tmp_path), torch.bfloat16), TorchPagedAttention(), "cpu")
    assert all(param.dtype == torch.bfloat16 for param in model.parameters())
    assert model.rotary.cos.dtype == torch.bfloat16
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(tokens[None, :]).logits[0]
    config = model.config
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    kv_caches = [
        (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
        for _ in range(config.num_layers)
    ]
    with torch.inference_mode():
        hidden = model(tokens, torch.arange(40), kv_caches, single_sequence_meta(0, 40))
        logits = model.compute_logits(hidden)
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the fp32 reference's logits are of order 1.
    assert (logits - expected).abs().max().item() < 0.1, (logits - expected).abs().max().item()
