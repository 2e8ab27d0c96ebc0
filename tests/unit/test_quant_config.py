"""A checkpoint's quantization_config decides how its tensors decode; a --quantization that
contradicts the checkpoint, or a variant the loader does not decode, fails at start-up in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model.loader import load_model_files
from engine.model.quant_config import CheckpointQuantization, check_requested, read_checkpoint_quantization
from harness.quant_checkpoints import hf_config

TINY = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=8)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 8, "desc_act": False, "sym": True}


def test_a_float_checkpoint_has_no_quantization(tmp_path):
    assert read_checkpoint_quantization(hf_config(TINY), str(tmp_path)) is None


def test_gptq_fields_and_the_zero_offset_of_each_checkpoint_format(tmp_path):
    def read(**fields):
        return read_checkpoint_quantization({"quantization_config": GPTQ | fields}, str(tmp_path))

    assert read() == CheckpointQuantization("gptq", 4, 8, zero_offset=1, desc_act=False, sym=True)
    assert read(checkpoint_format="gptq_v2").zero_offset == 0
    assert read(format="gptq_v2", desc_act=True, group_size=-1, bits=8) == CheckpointQuantization(
        "gptq", 8, -1, zero_offset=0, desc_act=True, sym=True)
    assert read(dynamic={"-:model.layers.0.mlp.down_proj": {}}).bits == 4


def test_autogptq_quantize_config_json_beside_config_json_is_read(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "sym": False}))
    quantization = read_checkpoint_quantization(hf_config(TINY), str(tmp_path))
    assert quantization == CheckpointQuantization("gptq", 4, 32, zero_offset=1, sym=False)


def test_awq_fields_in_transformers_and_autoawq_spelling(tmp_path):
    expected = CheckpointQuantization("awq", 4, 64, zero_offset=0)
    for fields in ({"bits": 4, "group_size": 64}, {"w_bit": 4, "q_group_size": 64, "version": "GEMM"}):
        raw = {"quantization_config": {"quant_method": "awq", "zero_point": True} | fields}
        assert read_checkpoint_quantization(raw, str(tmp_path)) == expected


@pytest.mark.parametrize(("fields", "message"), [
    (GPTQ | {"bits": 3}, r"quantization_config.bits: 3 is not supported for gptq \(supported: 4, 8\)"),
    (GPTQ | {"checkpoint_format": "marlin"}, r"quantization_config.checkpoint_format: 'marlin' is not supported"),
    (GPTQ | {"is_marlin_format": True}, r"quantization_config.is_marlin_format"),
    (GPTQ | {"pack_dtype": "int16"}, r"quantization_config.pack_dtype: 'int16' is not supported"),
    (GPTQ | {"dynamic": {r"+:.*\.1\..*": {"bits": 8}}}, r"quantization_config.dynamic: per-module"),
    (GPTQ | {"group_size": 0}, r"quantization_config.group_size: 0 is not a group size"),
    ({"quant_method": "awq", "bits": 8, "group_size": 64}, r"quantization_config.bits: 8 is not supported for awq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"},
     r"quantization_config.version: 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": False}, r"quantization_config.zero_point"),
    ({"quant_method": "fp8"}, r"quantization_config.quant_method: 'fp8' is not supported \(supported: gptq, awq\)"),
])
def test_a_variant_the_loader_does_not_decode_is_refused_naming_the_field(fields, message, tmp_path):
    with pytest.raises(ValueError, match=f"^{message}"):
        read_checkpoint_quantization({"quantization_config": fields}, str(tmp_path))


@pytest.mark.parametrize(("requested", "stored", "message"), [
    ("gptq", "gguf", "'gptq' does not fit m: it is a GGUF file"),
    ("gptq", "float", "'gptq' does not fit m: it is an unquantized \\(float\\) checkpoint"),
    ("awq", "gptq", "'awq' does not fit m: it is a GPTQ checkpoint"),
    ("gptq", "awq", "'gptq' does not fit m: it is an AWQ checkpoint"),
    ("none", "gptq", "'none' does not fit m: it is a GPTQ checkpoint \\(serve it with --quantization auto or gptq\\)"),
    ("gguf", "awq", "'gguf' does not fit m: it is an AWQ checkpoint"),
])
def test_a_flag_that_contradicts_the_checkpoint_is_refused(requested, stored, message):
    with pytest.raises(ValueError, match=f"^quantization: {message}"):
        check_requested(requested, stored, "m")


@pytest.mark.parametrize(("requested", "stored"), [
    ("auto", "gptq"), ("gptq", "gptq"), ("auto", "awq"), ("awq", "awq"), ("auto", "float"), ("none", "gguf")])
def test_auto_and_the_checkpoints_own_method_are_accepted(requested, stored):
    check_requested(requested, stored, "m")


def test_gptq_on_the_shipped_gguf_fails_at_start_up(model_files):
    with pytest.raises(ValueError, match=r"^quantization: 'gptq' does not fit .*\.gguf: it is a GGUF file"):
        Engine(EngineConfig(quantization="gptq"))
    with pytest.raises(ValueError, match=r"^quantization: 'awq' does not fit .*\.gguf: it is a GGUF file"):
        Engine(EngineConfig(quantization="awq"), files=model_files)


def _directory(path: Path, quantization_config: dict | None, tensors: dict[str, torch.Tensor] | None = None) -> str:
    path.mkdir()
    raw = hf_config(TINY) | ({} if quantization_config is None else {"quantization_config": quantization_config})
    (path / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_checkpoints_are_checked_against_the_flag_before_their_tensors_are_read(tmp_path):
    # No safetensors at all: each error comes from config.json alone.
    with pytest.raises(ValueError, match=r"^quantization: 'gptq' does not fit .*: it is an unquantized"):
        load_model_files(_directory(tmp_path / "float", None), torch.float32, "gptq")
    with pytest.raises(ValueError, match=r"^quantization: 'awq' does not fit .*: it is a GPTQ checkpoint"):
        load_model_files(_directory(tmp_path / "gptq", GPTQ), torch.float32, "awq")
    with pytest.raises(ValueError, match=r"^quantization_config.bits: 2 is not supported for gptq"):
        load_model_files(_directory(tmp_path / "two_bit", GPTQ | {"bits": 2}), torch.float32)


def test_missing_packed_tensors_are_named_at_start_up(tmp_path):
    layer = "model.layers.0.self_attn.q_proj"
    partial = {f"{layer}.qweight": torch.zeros(2, 16, dtype=torch.int32), f"{layer}.scales": torch.ones(2, 16)}
    with pytest.raises(ValueError, match=rf"^{layer}.qzeros: missing"):
        load_model_files(_directory(tmp_path / "partial", GPTQ, partial), torch.float32)
    with pytest.raises(ValueError, match=r"^quantization_config says gptq, but the checkpoint has no \*.qweight"):
        load_model_files(_directory(tmp_path / "none", GPTQ, {"model.norm.weight": torch.ones(16)}), torch.float32)
