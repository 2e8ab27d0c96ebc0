"""The formats an engine computes in, chosen at start-up from the hardware (engine.formats,
engine.hardware): the `--dtype auto` rule on injected CPU flags and GPUs, the weight formats it
implies, the combinations refused, and the start-up line."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.formats import resolve_formats
from engine.hardware import CpuFeatures, GpuFeatures, cpu_flags

AVX2 = "fpu sse sse2 avx fma f16c avx2"
SAPPHIRE_RAPIDS = CpuFeatures("Intel(R) Xeon(R) Platinum 8481C", frozenset(
    f"{AVX2} avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8".split()))
COOPER_LAKE = CpuFeatures("Intel(R) Xeon(R) Platinum 8380HL", frozenset(f"{AVX2} avx512f avx512_bf16".split()))
EPYC = CpuFeatures("AMD EPYC 7B12", frozenset(AVX2.split()))
H200 = GpuFeatures("NVIDIA H200", (9, 0))
T4 = GpuFeatures("Tesla T4", (7, 5))

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_bf16 amx_bf16 amx_tile
"""


def _formats(hardware, **config):
    return resolve_formats(EngineConfig(**config), hardware, "none")


def test_cpuinfo_gives_the_model_name_and_the_flags_of_the_first_processor(tmp_path):
    cpu = CpuFeatures.parse(CPUINFO)
    assert cpu.model_name == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert (cpu.has_avx2, cpu.has_fma, cpu.has_f16c, cpu.has_avx512f) == (True, True, True, True)
    assert (cpu.has_avx512_bf16, cpu.has_amx_bf16, cpu.has_avx512_fp16) == (True, True, False)
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_flags(str(path)) == cpu
    assert cpu_flags(str(tmp_path / "absent")).flags == frozenset()  # not Linux: no flag known


@pytest.mark.parametrize(("hardware", "dtype", "reason"), [
    (SAPPHIRE_RAPIDS, "bfloat16", "auto: the CPU computes bf16 natively (amx_bf16)"),
    (COOPER_LAKE, "bfloat16", "auto: the CPU computes bf16 natively (avx512_bf16)"),
    (EPYC, "float32", "auto: the CPU has neither amx_bf16 nor avx512_bf16"),
    (H200, "bfloat16", "auto: the GPU computes bf16"),
    (T4, "float16", "auto: no bf16 below compute capability 8.0"),
], ids=["amx", "avx512-bf16", "avx2", "cuda", "cuda-sm75"])
def test_auto_dtype_follows_the_hardware(hardware, dtype, reason):
    device = "cuda" if isinstance(hardware, GpuFeatures) else "cpu"
    formats = _formats(hardware, device=device)
    assert (formats.dtype, formats.dtype_reason, formats.warning) == (dtype, reason, None)
    assert formats.kv_cache_dtype == dtype and formats.quantization == "none"
    # fp16-held weights only where auto chose float32 on a CPU; one plain copy everywhere else.
    assert formats.cpu_weights == ("fp16" if dtype == "float32" else "plain")


def test_float32_asked_for_means_exact_weights_unless_cpu_weights_says_otherwise():
    assert _formats(SAPPHIRE_RAPIDS, dtype="float32").cpu_weights == "fp32"
    assert _formats(EPYC, dtype="float32").cpu_weights == "fp32"
    assert _formats(EPYC, dtype="float32", cpu_weights="fp16").cpu_weights == "fp16"
    assert _formats(EPYC, cpu_weights="plain").cpu_weights == "plain"
    assert _formats(EPYC, dtype="float32").dtype_reason == "as asked"


def test_a_dtype_the_cpu_only_emulates_is_served_with_a_warning():
    bf16 = _formats(EPYC, dtype="bfloat16")
    assert bf16.dtype == "bfloat16" and "emulated" in bf16.dtype_reason
    assert bf16.warning is not None and bf16.warning.startswith("dtype bfloat16: this CPU has no bf16 arithmetic")
    assert _formats(COOPER_LAKE, dtype="bfloat16").warning is None
    fp16 = _formats(COOPER_LAKE, dtype="float16")
    assert fp16.warning is not None and fp16.warning.startswith("dtype float16: this CPU has no fp16 arithmetic")
    assert _formats(SAPPHIRE_RAPIDS, dtype="float16").warning is None  # avx512_fp16


def test_weights_held_for_a_float32_cpu_product_are_refused_elsewhere_naming_the_flag():
    with pytest.raises(ValueError, match=r"^cpu_weights: 'fp16' applies to float32 on a CPU, not to dtype bfloat16 "
                                         r"\(auto: the CPU computes bf16 natively \(amx_bf16\)\)"):
        _formats(SAPPHIRE_RAPIDS, cpu_weights="fp16")
    with pytest.raises(ValueError, match=r"^cpu_weights: 'fp32' applies to float32 on a CPU, not to a GPU"):
        _formats(H200, device="cuda", dtype="float32", cpu_weights="fp32")
    with pytest.raises(ValueError, match=r"^dtype: unknown dtype 'fp8' \(choose from auto, float32, bfloat16, "):
        EngineConfig(dtype="fp8")  # type: ignore[arg-type]


EMERALD_RAPIDS = CpuFeatures("Intel(R) Xeon(R) Processor", frozenset(
    f"{AVX2} avx512f avx512bw avx512_bf16 avx512_vnni avx512_fp16".split()))


@pytest.mark.parametrize(("hardware", "config", "quantization", "chosen"), [
    (EMERALD_RAPIDS, {}, "gguf", "int8"),  # VNNI without AMX: int8 dot products outrun bf16 ones
    (EMERALD_RAPIDS, {}, "none", "none"),  # float weights: nothing to multiply as integers
    (EMERALD_RAPIDS, {"dtype": "float32"}, "gguf", "none"),  # float32 asked for: exact activations
    (EMERALD_RAPIDS, {"activation_quantization": "none"}, "gguf", "none"),
    (EMERALD_RAPIDS, {"activation_quantization": "int8", "dtype": "float32"}, "int8", "int8"),
    (EMERALD_RAPIDS, {"activation_quantization": "int16"}, "gguf", "int16"),
    (CpuFeatures("SPR", SAPPHIRE_RAPIDS.flags | {"avx512_vnni"}), {}, "gguf", "none"),  # AMX tiles are faster
    (COOPER_LAKE, {}, "gguf", "none"),  # no avx512_vnni listed
    (EPYC, {}, "gguf", "none"),
], ids=["vnni", "float-weights", "float32", "off", "asked", "int16", "amx", "no-vnni", "avx2"])
def test_auto_activation_quantization_is_int8_where_vnni_is_the_fast_path(hardware, config, quantization, chosen):
    assert resolve_formats(EngineConfig(**config), hardware, quantization).activation_quantization == chosen


def test_int8_activations_asked_for_where_they_cannot_run_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^activation_quantization: 'int8' needs a CPU with avx512_bf16 and "
                                         r"avx512_vnni and without amx_bf16; this is CPU \"AMD EPYC 7B12\""):
        resolve_formats(EngineConfig(activation_quantization="int8"), EPYC, "gguf")
    with pytest.raises(ValueError, match=r"^activation_quantization: 'int8' applies to integer-group weights"):
        resolve_formats(EngineConfig(activation_quantization="int8"), EMERALD_RAPIDS, "none")
    with pytest.raises(ValueError, match=r"^activation_quantization: unknown format 'fp8'"):
        EngineConfig(activation_quantization="fp8")  # type: ignore[arg-type]


def test_the_start_up_line_names_hardware_dtype_and_why_weight_and_kv_formats():
    assert _formats(EPYC).describe() == (
        'CPU "AMD EPYC 7B12" [avx2 fma f16c]: dtype=float32 (auto: the CPU has neither amx_bf16 nor '
        "avx512_bf16), quantization=none, cpu_weights=fp16 (rounded to fp16 for fbgemm's product), "
        "kv_cache_dtype=float32, activation_quantization=none")
    assert _formats(H200, device="cuda").describe() == (
        'GPU "NVIDIA H200" [sm_90]: dtype=bfloat16 (auto: the GPU computes bf16), quantization=none, '
        "cpu_weights=plain (one bfloat16 copy), kv_cache_dtype=bfloat16, activation_quantization=none")


def test_the_engine_resolves_its_formats_once_logs_them_and_converts_loaded_weights(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        engine = make_engine(dtype="bfloat16", cpu_weights="auto", cache=CacheConfig(num_blocks=4, memory_bytes=None))
    assert engine.formats == resolve_formats(engine.config, cpu_flags(), engine.formats.quantization)
    assert f"engine formats: {engine.formats.describe()}" in caplog.messages
    assert (engine.formats.warning in caplog.messages) == (engine.formats.warning is not None)
    # The session's weights are float32: the engine computes in its own dtype all the same.
    assert {param.dtype for param in engine.runner.model.parameters()} == {torch.bfloat16}
