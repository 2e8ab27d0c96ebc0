"""services.commands.engine_flags: the CLI only translates flags into EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from services.commands.engine_flags import add_engine_flags, engine_config


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
