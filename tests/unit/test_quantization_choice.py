"""Which weight format `--quantization` serves, and the one-line refusals of what cannot be served."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_model_hf import CONFIGS, save_random_model

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.kernels import kernels
from engine.model.weight_formats import choose_quantization


def test_auto_serves_a_gguf_files_blocks_on_cpu_and_float_weights_elsewhere():
    assert choose_quantization("auto", "gguf", "cpu") == "gguf"
    assert choose_quantization("auto", None, "cpu") == "none"  # float tensors (GGUF F32/F16, or HF)
    assert choose_quantization("auto", "gguf", "cuda") == "none"  # the kernels are CPU ones


def test_auto_serves_a_gptq_or_awq_checkpoints_own_groups_on_every_device():
    # Off CPU no kernel takes them: they are served dequantized, named in a warning (build_model).
    for method in ("gptq", "awq"):
        assert choose_quantization("auto", method, "cpu") == method
        assert choose_quantization("auto", method, "cuda") == method


def test_explicit_formats_are_served_where_they_apply():
    assert choose_quantization("int8", None, "cpu") == "int8"
    assert choose_quantization("int8", "gguf", "cpu") == "int8"
    assert choose_quantization("none", "gguf", "cuda") == "none"


def test_gguf_on_an_hf_directory_and_the_kernels_off_cpu_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^quantization: 'gguf' serves a GGUF file's own integer blocks; "
                                         r".*\(supported for it: auto, none, int8\)$"):
        choose_quantization("gguf", None, "cpu")
    with pytest.raises(ValueError, match=r"^quantization: 'int8' has CPU kernels only \(supported on cuda:0: "):
        choose_quantization("int8", None, "cuda:0")


def test_an_engine_on_an_hf_directory_refuses_gguf_before_serving(tmp_path: Path):
    save_random_model(CONFIGS["llama_gqa_tied"](), tmp_path)
    with pytest.raises(ValueError, match=r"^quantization: 'gguf' serves a GGUF file's own integer blocks"):
        Engine(EngineConfig(model=str(tmp_path), quantization="gguf"))


def test_without_a_compiler_auto_says_so_and_serves_dequantized_weights(monkeypatch, tmp_path, caplog):
    # A real failed build: an empty build folder and a "compiler" that always fails.
    monkeypatch.setenv("TANDEM_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    kernels.cache_clear()
    try:
        assert choose_quantization("auto", "gguf", "cpu") == "none"
        assert choose_quantization("auto", "gptq", "cpu") == "none"
        assert "the CPU kernels could not be built" in caplog.text
        with pytest.raises(ValueError, match=r"^quantization: 'gguf' needs the CPU kernels, which could not be built"):
            choose_quantization("gguf", "gguf", "cpu")
    finally:
        kernels.cache_clear()
