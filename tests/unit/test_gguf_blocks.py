"""GGUF's integer blocks as QuantizedWeights: bit for bit gguf-py's dequantization, the shipped
file's types, and a tiny file mixing served and unserved block types."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from test_model_hf import run_chunks

from engine.attention.reference import TorchPagedAttention
from engine.model.gguf_blocks import as_quantized
from engine.model.loader import ModelFiles, build_model, load_model_files
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import QuantizedLinear
from engine.model.weight_formats import ConcatenatedProducts

Q = GGMLQuantizationType


def _random(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def _random_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    # Any bytes are a Q4_K block once d and dmin are finite fp16 values.
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_block_types_dequantize_exactly_as_gguf_does(qtype):
    rows, cols = 6, 512
    data = _random_q4_k(rows, cols, 0) if qtype == Q.Q4_K else quantize(_random(rows, cols, 0), qtype)
    weight = as_quantized(data, qtype, (rows, cols))
    assert weight is not None and weight.group_size == 32
    expected = torch.from_numpy(dequantize(data, qtype).reshape(rows, cols))
    assert torch.equal(weight.dequantize(), expected)


def test_other_block_types_are_not_mapped():
    assert as_quantized(quantize(_random(2, 64, 0), Q.Q5_0), Q.Q5_0, (2, 64)) is None


def test_the_shipped_file_keeps_its_q4_1_layers_and_q8_0_embedding(model_files: ModelFiles):
    assert model_files.quantized_as == "gguf" and model_files.dequantized == {}
    q = model_files.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight) and (q.bits, q.group_size, q.q.dtype) == (4, 32, torch.uint8)
    assert q.offset is not None
    embedding = model_files.weights["model.embed_tokens.weight"]
    assert isinstance(embedding, QuantizedWeight) and (embedding.bits, embedding.offset) == (8, None)


# A one-layer llama: hidden 64, 2 heads of 32 (1 KV head), FFN 128, vocabulary 64.
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 1, 128, 64
TENSORS = {
    "token_embd.weight": ((VOCAB, HIDDEN), Q.Q8_0),
    "output_norm.weight": ((HIDDEN,), Q.F32),
    "blk.0.attn_norm.weight": ((HIDDEN,), Q.F32),
    "blk.0.ffn_norm.weight": ((HIDDEN,), Q.F32),
    "blk.0.attn_q.weight": ((HIDDEN, HIDDEN), Q.Q4_1),
    "blk.0.attn_k.weight": ((HIDDEN // HEADS, HIDDEN), Q.Q4_0),
    "blk.0.attn_v.weight": ((HIDDEN // HEADS, HIDDEN), Q.Q5_0),  # no kernel: dequantized, named
    "blk.0.attn_output.weight": ((HIDDEN, HIDDEN), Q.Q4_1),
    "blk.0.ffn_gate.weight": ((FFN, HIDDEN), Q.Q4_1),
    "blk.0.ffn_up.weight": ((FFN, HIDDEN), Q.Q4_1),
    "blk.0.ffn_down.weight": ((HIDDEN, FFN), Q.F16),
}


def write_tiny_gguf(path: Path) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(128)
    writer.add_vocab_size(VOCAB)
    for index, (name, (shape, qtype)) in enumerate(TENSORS.items()):
        values = _random(*shape, seed=index) * 0.2 if len(shape) == 2 else 1 + 0.1 * _random(1, shape[0], index)[0]
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_mixed_file_serves_what_has_a_kernel_and_names_the_rest(tmp_path: Path, caplog):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    files = load_model_files(str(path), torch.float32)
    assert files.dequantized == {"model.layers.0.self_attn.v_proj.weight": "Q5_0"}
    with caplog.at_level(logging.WARNING, logger="engine.model.loader"):
        served = build_model(files, TorchPagedAttention(), "cpu", quantization="gguf")
    assert "model.layers.0.self_attn.v_proj.weight (Q5_0)" in caplog.text
    # q (Q4_1) and k (Q4_0) differ in layout: each is its own product, v is dense; gate/up fuse.
    qkv = served.layers[0].linears["qkv"]
    assert isinstance(qkv, ConcatenatedProducts) and len(qkv.products) == 3
    assert isinstance(served.layers[0].linears["gate_up"], QuantizedLinear)
    # Same weights as the dequantized model: the logits differ only by fp32 summation order.
    dense = build_model(files, TorchPagedAttention(), "cpu", quantization="none")
    tokens = torch.arange(0, 40) % VOCAB
    torch.testing.assert_close(run_chunks(served, tokens, [20, 40]), run_chunks(dense, tokens, [20, 40]),
                               atol=1e-4, rtol=1e-4)
