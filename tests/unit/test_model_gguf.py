"""The shipped SmolLM2 GGUF: metadata read correctly, logits match transformers' dequantization of the same file."""

from __future__ import annotations

import pytest
import torch
from test_model_hf import run_chunks

from engine.attention.reference import TorchPagedAttention
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import ModelFiles, build_model
from engine.model.weight_formats import dense

SENTENCE = "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side."
NUM_TOKENS = 20
LOGIT_TOLERANCE = 5e-4


@pytest.fixture(scope="module")
def prompt_ids(reference_tokenizer) -> torch.Tensor:
    ids = reference_tokenizer(SENTENCE)["input_ids"][:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def model(model_files: ModelFiles) -> LlamaForCausalLM:
    return build_model(model_files, TorchPagedAttention(), "cpu")


def test_config_from_metadata(model_files: ModelFiles) -> None:
    config = model_files.config
    assert model_files.kind == "gguf"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings and "lm_head.weight" not in model_files.weights
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.name.startswith("Smollm2 135M")


def test_weights_equal_transformers_dequantization(model_files: ModelFiles, reference_model: torch.nn.Module) -> None:
    # Q and K are the rows GGUF permutes for llama.cpp's RoPE; the others check names and orientation.
    # The file's Q4_1 and Q8_0 blocks are kept as QuantizedWeights: dequantized, bit for bit gguf's values.
    expected = reference_model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(dense(model_files.weights[name], torch.float32), expected[name]), name


def test_logits_and_greedy_tokens_match_transformers(
    model: LlamaForCausalLM, reference_model: torch.nn.Module, prompt_ids: torch.Tensor
) -> None:
    with torch.inference_mode():
        expected = reference_model(prompt_ids[None, :]).logits[0].float()

    prefill = run_chunks(model, prompt_ids, [NUM_TOKENS])
    # A chunk over a cached prefix, then one-token decode steps.
    stepped = run_chunks(model, prompt_ids, [8, 14, *range(15, NUM_TOKENS + 1)])

    for logits in (prefill, stepped):
        assert (logits - expected).abs().max().item() < LOGIT_TOLERANCE
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
