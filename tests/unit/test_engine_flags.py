"""services.commands.engine_flags: the CLI only translates flags into EngineConfig; the flags are
generated from EngineFlags (services.common.config_flags) and passed on by the same."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig, KVTierConfig, LoraConfig
from engine.model.paths import default_model_path
from engine.structured.config import StructuredOutputsConfig
from services.commands.engine_flags import CPU_PROMPT_BATCH_TOKENS, EngineFlags, engine_config
from services.common.config_flags import add_flags, from_args, to_argv


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineFlags)
    return parser


def _flags(*argv: str) -> EngineFlags:
    return from_args(EngineFlags, _parser().parse_args(list(argv)))


def _config(*flags: str):
    return engine_config(_flags(*flags), "decode")


def test_formats_default_to_auto_which_the_engine_resolves_and_the_flags_choose_others():
    config = _config()
    assert (config.dtype, config.cpu_weights, config.quantization, config.kv_cache_dtype,
            config.activation_quantization) == ("auto",) * 5
    assert _config("--activation-quantization", "int16").activation_quantization == "int16"
    assert _config("--dtype", "float32").dtype == "float32"
    assert _config("--dtype", "bfloat16").dtype == "bfloat16"
    assert _config("--cpu-weights", "fp32").cpu_weights == "fp32"
    assert _config("--cpu-weights", "plain").cpu_weights == "plain"
    with pytest.raises(SystemExit):
        _config("--dtype", "half")


ENGINE_FLAGS = ["--model", "/m.gguf", "--device", "cuda:1", "--dtype", "float16", "--attention-backend", "triton",
                "--threads", "2", "--cpu-weights", "plain", "--quantization", "none", "--kv-cache-dtype", "int8",
                "--kv-cache-mib", "64", "--kv-cache-blocks", "9", "--block-size", "32",
                "--kv-sliding-window", "64", "--kv-sink-tokens", "4", "--kv-budget-tokens", "256",
                "--kv-budget-recent-tokens", "64", "--kv-budget-observation-tokens", "8", "--max-num-seqs", "3",
                "--max-num-batched-tokens", "100", "--max-prompt-batch-tokens", "0", "--max-model-len", "512",
                "--no-prefix-caching", "--activation-quantization", "none",
                "--speculative-config", '{"num_speculative_tokens": 3}', "--tensor-parallel-size", "3",
                "--enable-expert-parallel", "--pipeline-parallel-size", "2", "--prefill-context-parallel-size", "2",
                "--prefill-context-parallel-min-tokens", "64", "--kv-host-tier", "/run/h.sock",
                "--kv-disk-tier", "/var/kv", "--kv-disk-tier-mib", "10",
                "--structured-outputs-config", '{"disable_any_whitespace": true}',
                "--model-repository", "/r.toml", "--model-version", "m@v", "--pool", "p",
                "--enable-lora", "--lora-modules", "a=/a", "--lora-modules", '{"name": "b", "path": "/b"}',
                "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3"]


def test_engine_flags_pass_on_as_arguments_that_parse_back_to_the_same_values():
    flags = _flags(*ENGINE_FLAGS)
    assert vars(_parser().parse_args(to_argv(flags))) == vars(_parser().parse_args(ENGINE_FLAGS))
    assert _flags(*to_argv(flags)) == flags
    assert to_argv(_flags("--dtype", "float32")) == ["--dtype", "float32"]
    assert to_argv(_flags()) == []


def test_structured_outputs_config_flag():
    assert _config().structured_outputs == StructuredOutputsConfig()
    given = _config("--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}')
    assert given.structured_outputs == StructuredOutputsConfig("guidance", disable_any_whitespace=True)


def test_speculative_config_flag():
    assert _config().speculative is None
    spec = _config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 6}').speculative
    assert spec is not None and spec.num_speculative_tokens == 6 and spec.prompt_lookup_max == 4
    with pytest.raises(ValueError, match="--speculative-config: num_speculative_tokens: must be in"):
        _config("--speculative-config", '{"num_speculative_tokens": 0}')
    with pytest.raises(ValueError, match="--speculative-config: the prefill role"):
        engine_config(_flags("--speculative-config", "{}"), "prefill")


def test_the_kv_tier_flags_reach_the_engine_config():
    assert not _config().kv_tiers.enabled
    config = _config("--kv-host-tier", "/run/h.sock", "--kv-disk-tier", "/var/kv", "--kv-disk-tier-mib", "10")
    assert config.kv_tiers == KVTierConfig(host_socket="/run/h.sock", disk_dir="/var/kv", disk_bytes=10 * 1024**2)
    with pytest.raises(ValueError, match="kv_host_tier: KV tiers serve a single-process engine"):
        _config("--kv-disk-tier", "/var/kv", "--tensor-parallel-size", "2")


def test_the_parallel_layout_flags_reach_the_engine_config():
    config = _config("--tensor-parallel-size", "2", "--enable-expert-parallel", "--pipeline-parallel-size", "3")
    assert (config.tensor_parallel_size, config.enable_expert_parallel, config.pipeline_parallel_size) == (2, True, 3)
    assert config.parallel_sizes == {"tensor_parallel_size": 2, "expert_parallel_size": 2,
                                     "prefill_context_parallel_size": 1, "pipeline_parallel_size": 3}
    split = _config("--prefill-context-parallel-size", "2", "--prefill-context-parallel-min-tokens", "64")
    assert (split.prefill_context_parallel_size, split.prefill_context_parallel_min_tokens) == (2, 64)
    assert split.world_size == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size: 2 with prefill_context_parallel_size 2"):
        _config("--pipeline-parallel-size", "2", "--prefill-context-parallel-size", "2")


def test_every_engine_flag_is_named_after_its_attribute_so_it_passes_on():
    flags = {action.dest: action.option_strings for action in _parser()._actions if action.dest != "help"}
    assert all(f"--{dest.replace('_', '-')}" in names for dest, names in flags.items()), flags
    assert set(flags) <= {arg[2:].replace("-", "_") for arg in ENGINE_FLAGS if arg.startswith("--")}, (
        "a new engine flag: give it a non-default value in ENGINE_FLAGS")


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

    model = default_model_path()  # the shipped GGUF file: refused from its name, before a tensor is read
    with pytest.raises(ValueError, match=r"^quantization: 'gptq' does not fit .*: it is a GGUF file"):
        Engine(EngineConfig(quantization="gptq", model=model))
    with pytest.raises(ValueError, match=r"^quantization: unknown method 'q4'"):
        EngineConfig(quantization="q4")  # type: ignore[arg-type]


def test_lora_flags_take_vllm_names_and_both_module_forms():
    assert _config().lora is None
    lora = _config("--enable-lora", "--lora-modules", "sql=/a/sql", "--lora-modules",
                   '{"name": "chat", "path": "/a/chat"}', "--max-loras", "2", "--max-lora-rank", "8",
                   "--max-cpu-loras", "4").lora
    assert lora == LoraConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=4,
                              modules=(("sql", "/a/sql"), ("chat", "/a/chat")))
    assert _config("--enable-lora").lora == LoraConfig()


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora-modules", "a=/a"], "--lora-modules: serves LoRA adapters, which --enable-lora turns on"),
    (["--max-loras", "2"], "--max-loras: serves LoRA adapters"),
    (["--enable-lora", "--lora-modules", "/a"], "--lora-modules: '/a': give NAME=PATH"),
    (["--enable-lora", "--lora-modules", "{nope"], "--lora-modules: '{nope' is not JSON"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], "--lora-modules: .*give"),
    (["--enable-lora", "--lora-modules", "a=/a", "--lora-modules", "a=/b"], "--lora-modules: a name given twice"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras: must be at least 1"),
    (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank: must be at least 1"),
    (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"], "--max-cpu-loras: 2 must be at least"),
])
def test_a_bad_lora_flag_is_a_start_up_error_naming_it(argv, message):
    with pytest.raises(ValueError, match=message):
        _config(*argv)
