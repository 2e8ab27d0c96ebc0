"""services.commands.engine_flags: the CLI only translates flags into EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from services.commands.engine_flags import CPU_PROMPT_BATCH_TOKENS, add_engine_flags, engine_config


def _config(*flags: str):
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return engine_config(parser.parse_args(list(flags)), "decode")


def test_cpu_weights_default_to_fp16_and_the_flag_chooses_another_format():
    assert _config().cpu_weights == "fp16"
    assert _config("--cpu-weights", "fp32").cpu_weights == "fp32"
    assert _config("--cpu-weights", "plain").cpu_weights == "plain"


def test_unknown_cpu_weight_format_is_a_usage_error():
    with pytest.raises(SystemExit):
        _config("--cpu-weights", "int4")


def test_prompt_batching_is_limited_on_cpu_by_default_and_not_on_gpu():
    assert _config().scheduler.max_prompt_batch_tokens == CPU_PROMPT_BATCH_TOKENS
    assert _config("--device", "cuda").scheduler.max_prompt_batch_tokens is None
    assert _config("--max-prompt-batch-tokens", "512").scheduler.max_prompt_batch_tokens == 512
    assert _config("--max-prompt-batch-tokens", "0").scheduler.max_prompt_batch_tokens is None


def test_a_negative_prompt_batch_limit_is_refused():
    with pytest.raises(ValueError, match="max_prompt_batch_tokens"):
        _config("--max-prompt-batch-tokens", "-1")


def test_a_format_the_engine_cannot_compute_is_refused_before_loading_naming_the_field():
    from engine.engine import Engine

    with pytest.raises(ValueError, match=r"^quantization: 'awq' is not supported \(supported: auto, none\)"):
        Engine(EngineConfig(quantization="awq", model="/nonexistent.gguf"))
    with pytest.raises(ValueError, match=r"^quantization: unknown method 'q4'"):
        EngineConfig(quantization="q4")  # type: ignore[arg-type]
