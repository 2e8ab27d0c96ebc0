"""The number formats an engine computes in, resolved once at start-up from its config and the
hardware (engine.hardware): no "auto" survives here.

`--dtype auto` follows the hardware (vLLM's follows the checkpoint; the shipped GGUF's 4-bit
blocks are neither bf16 nor fp32): bfloat16 on a GPU that computes it (compute capability 8.0 and
up, else float16); on a CPU, bfloat16 where the processor multiplies it natively (AMX-BF16 or
AVX512-BF16), else float32. `--cpu-weights auto` then holds float32 weights at fp16 for the faster
decode product when float32 came from `auto` (today's default on such a CPU) and exact when
`--dtype float32` was asked for, so `--dtype float32 --quantization none` means exact fp32 weights
and arithmetic.

`--activation-quantization auto` quantizes the inputs of integer-group products to int8 blocks
(engine.model.int8_activations) where that is the fast path: bfloat16 on a CPU whose kernels build
has the VNNI GEMM (avx512_bf16 and avx512_vnni) and no AMX (whose bf16 tiles are faster still).
Elsewhere, and for float weights, activations stay in the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import CpuWeights, DType, DTypeOption, EngineConfig
from engine.hardware import GPU_BF16_CAPABILITY, CpuFeatures, GpuFeatures, Hardware
from engine.kv_cache.codec import kv_format

_CPU_WEIGHTS = {"fp16": "rounded to fp16 for fbgemm's product", "fp32": "exact, oneDNN-packed"}


@dataclass(frozen=True)
class DTypeChoice:
    """A dtype, why it was chosen, and what to warn about (None: the hardware computes it natively)."""

    dtype: DType
    reason: str
    warning: str | None = None


@dataclass(frozen=True)
class EngineFormats:
    """What an engine computes in: the dtype of activations and arithmetic, the weight format, the
    KV cache's element dtype, on which hardware and why."""

    hardware: str  # e.g. 'CPU "AMD EPYC" [avx2 fma f16c]'
    dtype: DType
    dtype_reason: str
    quantization: str  # the weight format: "none" (weights in `dtype`), or a quantized format
    cpu_weights: CpuWeights  # how float32 products on CPU hold their weights; "plain" everywhere else
    kv_cache_dtype: str  # the KV cache's element dtype ("auto" resolved to `dtype`)
    activation_quantization: str = "none"  # "int8"/"int16": integer-group products quantize their inputs
    warning: str | None = None  # a format the hardware only emulates

    def describe(self) -> str:
        """The start-up line: hardware, dtype and why, weight format, KV cache dtype."""
        held = _CPU_WEIGHTS.get(self.cpu_weights, f"one {self.dtype} copy")
        return (f"{self.hardware}: dtype={self.dtype} ({self.dtype_reason}), quantization={self.quantization}, "
                f"cpu_weights={self.cpu_weights} ({held}), kv_cache_dtype={self.kv_cache_dtype}, "
                f"activation_quantization={self.activation_quantization}")


def resolve_formats(config: EngineConfig, hardware: Hardware, quantization: str) -> EngineFormats:
    """The formats `config` asks for on `hardware`, serving its weights in `quantization` (what
    engine.model.weight_formats.choose_quantization chose for the checkpoint). ValueError naming
    the flag for a combination that cannot run (e.g. fp16-held weights in a bfloat16 engine)."""
    choice = choose_dtype(config.dtype, hardware)
    return EngineFormats(
        hardware=hardware.describe(),
        dtype=choice.dtype,
        dtype_reason=choice.reason,
        quantization=quantization,
        cpu_weights=_cpu_weights(config, choice, hardware),
        kv_cache_dtype=kv_format(config.kv_cache_dtype, choice.dtype).name,
        activation_quantization=_activation_quantization(config, choice, hardware, quantization),
        warning=choice.warning,
    )


def _activation_quantization(config: EngineConfig, choice: DTypeChoice, hardware: Hardware, quantization: str) -> str:
    asked = config.activation_quantization
    if asked == "none":
        return "none"
    cpu = isinstance(hardware, CpuFeatures)
    vnni = cpu and hardware.has_avx512_vnni and hardware.has_avx512_bf16 and not hardware.has_amx_bf16
    if asked == "auto":
        return "int8" if vnni and choice.dtype == "bfloat16" and quantization != "none" else "none"
    if quantization == "none":
        raise ValueError(f"activation_quantization: {asked!r} applies to integer-group weights; --quantization none "
                         "serves float weights (supported here: auto, none)")
    if not vnni:
        raise ValueError(f"activation_quantization: {asked!r} needs a CPU with avx512_bf16 and avx512_vnni and "
                         f"without amx_bf16; this is {hardware.describe()} (supported here: auto, none)")
    return asked


def choose_dtype(asked: DTypeOption, hardware: Hardware) -> DTypeChoice:
    """The dtype `--dtype asked` runs in on `hardware` (the rule in this module's docstring)."""
    if isinstance(hardware, GpuFeatures):
        if asked != "auto":
            return DTypeChoice(asked, "as asked")
        if hardware.has_bf16:
            return DTypeChoice("bfloat16", "auto: the GPU computes bf16")
        major, minor = GPU_BF16_CAPABILITY
        return DTypeChoice("float16", f"auto: no bf16 below compute capability {major}.{minor}")
    native = hardware.bf16_instruction
    if asked == "auto":
        if native is not None:
            return DTypeChoice("bfloat16", f"auto: the CPU computes bf16 natively ({native})")
        return DTypeChoice("float32", "auto: the CPU has neither amx_bf16 nor avx512_bf16")
    if asked == "bfloat16" and native is None:
        return DTypeChoice("bfloat16", "as asked; emulated: the CPU has neither amx_bf16 nor avx512_bf16",
                           "dtype bfloat16: this CPU has no bf16 arithmetic (neither amx_bf16 nor avx512_bf16); "
                           "torch emulates it, far slower than --dtype float32")
    if asked == "float16" and not hardware.has_avx512_fp16:
        return DTypeChoice("float16", "as asked; emulated: the CPU has no avx512_fp16",
                           "dtype float16: this CPU has no fp16 arithmetic (no avx512_fp16); torch computes each "
                           "operation in fp32 and rounds its result to fp16, far slower than --dtype float32")
    return DTypeChoice(asked, "as asked")


def _cpu_weights(config: EngineConfig, choice: DTypeChoice, hardware: Hardware) -> CpuWeights:
    applies = isinstance(hardware, CpuFeatures) and choice.dtype == "float32"
    if config.cpu_weights == "auto":
        if not applies:
            return "plain"
        return "fp16" if config.dtype == "auto" else "fp32"
    if config.cpu_weights != "plain" and not applies:
        on_gpu = isinstance(hardware, GpuFeatures)
        here = "a GPU" if on_gpu else f"dtype {choice.dtype} ({choice.reason})"
        raise ValueError(f"cpu_weights: {config.cpu_weights!r} applies to float32 on a CPU, not to {here} "
                         f"(supported here: auto, plain{'' if on_gpu else '; or pass --dtype float32'})")
    return config.cpu_weights
