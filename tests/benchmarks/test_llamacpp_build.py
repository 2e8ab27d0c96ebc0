"""The llama.cpp baseline's build key: which ggml instruction-set options a CPU's flags turn on, and
the cache folder's name, which must differ whenever the compiled-in instruction sets differ."""

from __future__ import annotations

from bench.llamacpp.build import GGML_ISA, build_key, cmake_args, ggml_options

EPYC_AVX2 = ["fpu", "sse4_1", "sse4_2", "avx", "f16c", "sse4a", "bmi1", "avx2", "bmi2", "fma"]
XEON_AMX = [*EPYC_AVX2, "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni",
                        "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"]


def _on(options: dict[str, bool]) -> list[str]:
    return [option for option, on in options.items() if on]


def test_an_avx2_cpu_builds_avx2_fma_f16c_and_nothing_wider():
    options = ggml_options(EPYC_AVX2)
    assert _on(options) == ["GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C"]
    assert build_key(options, "x86_64") == "llama-cpp-0.3.36-x86_64-sse42-avx-avx2-bmi2-fma-f16c"


def test_every_option_is_explicit_and_native_tuning_off():
    args = cmake_args(ggml_options(EPYC_AVX2))
    assert "-DGGML_NATIVE=OFF" in args
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX2=ON" in args
    defined = {arg.removeprefix("-D").split("=")[0] for arg in args}
    assert {option for option, _, _ in GGML_ISA} <= defined  # none left to ggml's defaults


def test_amx_is_compiled_in_only_when_asked():
    without = ggml_options(XEON_AMX)
    assert without["GGML_AVX512_BF16"] and without["GGML_AVX_VNNI"] and not without["GGML_AMX_TILE"]
    with_amx = ggml_options(XEON_AMX, amx=True)
    assert with_amx["GGML_AMX_TILE"] and with_amx["GGML_AMX_BF16"]
    assert build_key(without, "x86_64") != build_key(with_amx, "x86_64")
    assert build_key(with_amx, "x86_64").endswith("-avx512bf16-amxtile-amxint8-amxbf16")


def test_avx512_needs_all_five_subsets_its_flags_compile_for():
    partial = ggml_options([*EPYC_AVX2, "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512_bf16"])  # no avx512bw
    assert not partial["GGML_AVX512"] and not partial["GGML_AVX512_BF16"]


def test_a_cpu_without_the_flags_gets_a_baseline_key():
    assert build_key(ggml_options([]), "aarch64") == "llama-cpp-0.3.36-aarch64-baseline"
