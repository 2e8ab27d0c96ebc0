"""The benchmarks' GPTQ/AWQ checkpoints of the shipped model (harness/quant_checkpoints.py's
`shipped_checkpoint`), built from an HF export: every linear layer packed, every other tensor kept as
it was, and nothing built twice. A one-block model stands in for the export, so each build takes
milliseconds; test_gptq_awq_checkpoints.py serves a checkpoint of the shipped model itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.model.loader import load_model_files
from harness.quant_checkpoints import (
    SHIPPED_LAYOUTS,
    hf_config,
    input_seed,
    is_linear,
    quantize,
    shipped_checkpoint,
)

TINY = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=32, tie_word_embeddings=True)
SHAPES = {"model.embed_tokens.weight": (32, 64), "model.norm.weight": (64,),
          "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.post_attention_layernorm.weight": (64,),
          "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
          "model.layers.0.self_attn.v_proj.weight": (32, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
          "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.up_proj.weight": (128, 64),
          "model.layers.0.mlp.down_proj.weight": (64, 128)}


@pytest.fixture
def export(tmp_path) -> Path:
    """A float HF export as bench/suites/hf_export.py writes one: fp32, the LM head tied to the embedding."""
    directory = tmp_path / "export"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config(TINY)), encoding="utf-8")
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()},
              str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_text("{}", encoding="utf-8")
    return directory


@pytest.mark.parametrize("name", list(SHIPPED_LAYOUTS))
def test_a_checkpoint_loads_as_the_exports_layers_quantized_and_its_other_tensors_as_they_were(name, export,
                                                                                              tmp_path):
    root = tmp_path / "checkpoints"
    layout = SHIPPED_LAYOUTS[name]
    files = load_model_files(str(shipped_checkpoint(name, export, root)), torch.float32)
    tensors = load_file(str(export / "model.safetensors"))
    assert files.quantized_as == layout.method
    assert files.quantized.keys() == {layer for layer in tensors if is_linear(layer)} and len(files.quantized) == 7
    for layer, loaded in files.quantized.items():
        assert torch.equal(loaded.dequantize(), quantize(tensors[layer], layout, input_seed(layer)).dequantize())
    assert files.weights.keys() - files.quantized.keys() == tensors.keys() - files.quantized.keys()
    for other in tensors.keys() - files.quantized.keys():
        assert torch.equal(files.weights[other], tensors[other]), other
    assert {path.name for path in root.iterdir()} == {"float.safetensors", name}  # no .partial left


def test_a_checkpoint_already_built_is_not_built_again(export, tmp_path):
    built = shipped_checkpoint("awq-g32", export, tmp_path / "checkpoints")
    (export / "model.safetensors").unlink()  # what a second build would read
    assert shipped_checkpoint("awq-g32", export, tmp_path / "checkpoints") == built
    assert load_model_files(str(built), torch.float32).quantized_as == "awq"
