"""Mixture-of-experts GGUF files (llama.cpp's `llama` with experts, `qwen2moe`, `qwen3moe`) written from
random transformers models by harness.moe_gguf: every tensor as gguf-py reads it, logits as
transformers computes them, quantized experts served from their blocks, and what is refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from engine.attention.reference import TorchPagedAttention
from engine.config import ModelConfig
from engine.model.loader import build_model, load_model_files
from engine.model.moe import ExpertLoop, SparseMoE
from engine.model.quantized import QuantizedWeight, Weight
from engine.model.quantized_linear import QuantizedLinear
from engine.model.weight_formats import dense
from harness.moe_gguf import write_moe_gguf
from tests.unit.test_model_hf import VOCAB, run_chunks

EXPERTS = 8
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.1, intermediate_size=64, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**_SHAPE, num_local_experts=EXPERTS, sliding_window=None),
    "qwen2_moe": lambda: Qwen2MoeConfig(**_SHAPE, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                        num_experts=EXPERTS),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_SHAPE, moe_intermediate_size=64, num_experts=EXPERTS, head_dim=16,
                                        norm_topk_prob=True),
}
# The model's config each file is read as: (HF class, top-k renormalised, shared expert size, q/k norms, qkv bias).
EXPECTED = {
    "mixtral": ("MixtralForCausalLM", True, 0, False, False),
    "qwen2_moe": ("Qwen2MoeForCausalLM", False, 96, False, True),
    "qwen3_moe": ("Qwen3MoeForCausalLM", True, 0, True, False),
}
# llama.cpp's tensor names (gguf constants' MODEL_TENSORS) -> the HF names the model reads; experts by {e}.
_HF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def random_model(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    hf_config: PretrainedConfig = CONFIGS[variant]()
    reference = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Random init leaves biases and norm weights at trivial values; perturb them so they are exercised.
        for name, param in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return reference


def gguf_py_weights(path: Path, rope_heads: dict[str, int]) -> dict[str, np.ndarray]:
    """The file's tensors as gguf-py reads and dequantizes them, under the model's HF names: stacks of
    experts split, and q/k rows (`rope_heads`: GGUF kind -> heads) back in HF's rotate-half order."""
    weights: dict[str, np.ndarray] = {}
    for tensor in GGUFReader(path).tensors:
        array = np.array(dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)]))
        parts = tensor.name.split(".")
        if parts[0] != "blk":
            weights[f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"] = array
            continue
        layer, kind, suffix = parts[1:]
        name = f"model.layers.{layer}.{_HF_NAMES[kind]}.{suffix}"
        if kind in rope_heads:  # llama.cpp's converter made each head's pairs (i, i + d/2) adjacent rows
            heads, rows = rope_heads[kind], array.shape[0]
            array = array.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(array.shape)
        if "{e}" in name:
            weights.update({name.format(e=e): array[e] for e in range(array.shape[0])})
        else:
            weights[name] = array.reshape(1, -1) if kind == "ffn_gate_inp_shexp" else array
    return weights


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_each_architecture_reads_as_gguf_py_reads_it_and_runs_as_transformers(variant: str, tmp_path: Path) -> None:
    reference = random_model(variant)
    path = tmp_path / f"{variant}.gguf"
    write_moe_gguf(reference, path)
    files = load_model_files(str(path), torch.float32)

    config, moe = files.config, files.config.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (EXPERTS, 2, 64)
    assert (config.architecture, moe.normalize_top_k, moe.shared_intermediate_size, config.qk_norm,
            config.attention_bias) == EXPECTED[variant]
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert files.kind == "gguf" and files.quantized_as is None and files.dequantized == {}

    rope_heads = {"attn_q": 4, "attn_k": 2} if variant == "mixtral" else {}
    expected = gguf_py_weights(path, rope_heads)
    assert files.weights.keys() == expected.keys()
    for name, weight in files.weights.items():
        assert isinstance(weight, torch.Tensor) and torch.equal(weight, torch.from_numpy(expected[name])), name

    model = build_model(files, TorchPagedAttention(), "cpu")
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = reference(tokens[None, :]).logits[0].float()
    for chunks in ([40], [30, 40]):
        assert (run_chunks(model, tokens, chunks) - logits).abs().max().item() < 1e-4


@pytest.mark.parametrize(("variant", "expert_type", "dense_type"), [
    ("mixtral", "Q4_0", "Q8_0"),  # q/k rows permuted as integer groups too
    ("qwen2_moe", "Q8_0", "F32"),
])
def test_quantized_experts_are_served_from_their_blocks(variant: str, expert_type: str, dense_type: str,
                                                        tmp_path: Path) -> None:
    path = tmp_path / f"{variant}.gguf"
    write_moe_gguf(random_model(variant), path, expert_type=expert_type, dense_type=dense_type)
    files = load_model_files(str(path), torch.float32)
    expert = files.weights["model.layers.1.mlp.experts.7.down_proj.weight"]
    assert isinstance(expert, QuantizedWeight) and expert.shape == (64, 64) and files.quantized_as == "gguf"
    assert isinstance(files.weights["model.layers.0.mlp.gate.weight"], torch.Tensor)  # the router stays F32
    # Each expert's blocks dequantize to gguf-py's values for that expert.
    rope_heads = {"attn_q": 4, "attn_k": 2} if variant == "mixtral" else {}
    for name, values in gguf_py_weights(path, rope_heads).items():
        assert torch.equal(dense(files.weights[name], torch.float32), torch.from_numpy(values)), name

    served = build_model(files, TorchPagedAttention(), "cpu", quantization="gguf")
    moe = served.layers[0].moe
    assert isinstance(moe, SparseMoE) and isinstance(moe.experts, ExpertLoop)
    assert all(isinstance(e.gate_up, QuantizedLinear) and isinstance(e.down, QuantizedLinear)
               for e in moe.experts.experts.values())
    # Same weights as the dequantized model: the logits differ only by fp32 summation order.
    dequantized = build_model(files, TorchPagedAttention(), "cpu", quantization="none")
    tokens = torch.arange(0, 40) % VOCAB
    torch.testing.assert_close(run_chunks(served, tokens, [20, 40]), run_chunks(dequantized, tokens, [20, 40]),
                               atol=1e-4, rtol=1e-4)


def test_keep_takes_each_expert_by_name_and_may_drop_it(tmp_path: Path) -> None:
    """Expert parallelism's `keep` sees every expert's weight under its own name, as it is read, and
    returns None for the experts another rank holds."""
    path = tmp_path / "qwen3_moe.gguf"
    write_moe_gguf(random_model("qwen3_moe"), path, expert_type="Q8_0")
    seen: list[str] = []

    def first_half(name: str) -> bool:  # model.layers.N.mlp.experts.E.<projection>.weight
        return int(name.split(".")[5]) < EXPERTS // 2

    def keep(config: ModelConfig, name: str, weight: Weight) -> Weight | None:
        seen.append(name)
        return None if ".experts." in name and not first_half(name) else weight

    files = load_model_files(str(path), torch.float32, keep=keep)
    experts = [name for name in seen if ".experts." in name]
    assert len(seen) == len(set(seen)) and len(experts) == 2 * EXPERTS * 3
    assert {name for name in files.weights if ".experts." in name} == set(filter(first_half, experts))
    assert all(isinstance(files.weights[name], QuantizedWeight) for name in filter(first_half, experts))


def write_header_only(path: Path, architecture: str, metadata: dict[str, int],
                      tensors: dict[str, tuple[int, ...]]) -> None:
    """A file of `architecture` with llama.cpp's basic keys, `metadata` (under `{architecture}.`) and zero tensors."""
    writer = GGUFWriter(str(path), architecture)
    for key, value in {"embedding_length": 64, "feed_forward_length": 64, "block_count": 1, "context_length": 128,
                       "attention.head_count": 4, "vocab_size": VOCAB, **metadata}.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("architecture", "metadata", "fragment"), [
    ("gemma", {}, "unsupported GGUF architecture 'gemma'; supported: llama, qwen2, qwen3, qwen2moe, qwen3moe"),
    ("qwen3moe", {}, "a 'qwen3moe' GGUF file without experts"),
    ("qwen2", {"expert_count": 8, "expert_used_count": 2}, "a 'qwen2' GGUF file with experts"),
    ("qwen3moe", {"expert_count": 8, "expert_used_count": 2, "expert_gating_func": 2},
     "qwen3moe.expert_gating_func=2"),
    ("qwen3moe", {"expert_count": 8, "expert_used_count": 2, "leading_dense_block_count": 1},
     "qwen3moe.leading_dense_block_count=1"),
])
def test_architectures_and_variants_not_served_are_named(architecture: str, metadata: dict[str, int],
                                                         fragment: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_header_only(path, architecture, metadata, {"token_embd.weight": (VOCAB, 64)})
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_model_files(str(path), torch.float32)


def test_a_stack_of_experts_disagreeing_with_expert_count_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_header_only(path, "qwen3moe", {"expert_count": 8, "expert_used_count": 2},
                      {"blk.0.ffn_gate_exps.weight": (4, 64, 64)})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight has shape \[4, 64, 64\]; expected 8 experts"):
        load_model_files(str(path), torch.float32)


def test_the_writer_refuses_what_llama_cpp_would_compute_otherwise(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_config(Qwen2MoeConfig(**_SHAPE, moe_intermediate_size=64, num_experts=4,
                                                            norm_topk_prob=True))
    with pytest.raises(ValueError, match=r"norm_topk_prob=True: llama\.cpp's qwen2moe computes False"):
        write_moe_gguf(model, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()
