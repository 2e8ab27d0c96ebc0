"""The formats the fidelity suite scores, one row each: the EngineConfig fields that select it, the
row it is held against and issue 20's bound on its perplexity (issue 44's for the KV formats).

A row names EngineConfig fields, not flags (its "cache" entry CacheConfig's), so that a format another
branch adds is a row here as soon as its field accepts the value; until then the engine refuses it at
start-up (a ValueError naming the field) and the suite shows the row as skipped with that message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REFERENCE = "fp32"


@dataclass(frozen=True)
class Format:
    """One row: `settings` are EngineConfig fields; `bound` the largest relative rise of perplexity
    over row `against` the issue allows (None: reported, no bound); `checkpoint` names the suite flag
    that gives the model this format needs, if the shipped one is not in it, and `built` the checkpoint
    of the shipped model (harness/quant_checkpoints.py's SHIPPED_LAYOUTS) used without that flag;
    `retrieval` whether the long-context retrieval check (bench/fidelity/retrieval.py) scores it too."""

    name: str
    description: str
    settings: dict[str, Any] = field(default_factory=dict)
    against: str | None = REFERENCE
    bound: float | None = None
    checkpoint: str | None = None
    built: str | None = None
    retrieval: bool = False


FORMATS: tuple[Format, ...] = (
    Format(REFERENCE, "fp32 weights and arithmetic, exact (the dequantized GGUF)",
           {"dtype": "float32", "quantization": "none", "cpu_weights": "fp32"}, against=None, retrieval=True),
    Format("fp32-fp16w", "fp32 arithmetic, weights rounded to fp16 (fbgemm's fp16-weight product)",
           {"dtype": "float32", "quantization": "none", "cpu_weights": "fp16"}),
    Format("bf16", "bf16 weights and activations", {"dtype": "bfloat16", "quantization": "none"}, bound=0.01),
    # The issue bounds bf16; fp16 has three more mantissa bits, so bf16's bound holds it too.
    Format("fp16", "fp16 weights and activations", {"dtype": "float16", "quantization": "none"}, bound=0.01),
    Format("auto", "the defaults: --dtype auto, the file's own quantization",
           {"dtype": "auto", "quantization": "auto"}),
    # The GGUF blocks are the model's own weights: held against the same weights dequantized, same dtype.
    Format("gguf", "the file's Q4_1/Q8_0 blocks served as they are, fp32 activations",
           {"dtype": "float32", "quantization": "gguf"}, bound=0.005),
    Format("gguf-bf16", "the file's blocks, bf16 activations",
           {"dtype": "bfloat16", "quantization": "gguf", "activation_quantization": "none"},
           against="bf16", bound=0.005),
    # Held to the blocks' bound against bf16 with dense weights: the activations' int8 blocks count in the rise.
    Format("gguf-a8", "the file's blocks, bf16 activations quantized to int8 blocks of 32 for each product",
           {"dtype": "bfloat16", "quantization": "gguf", "activation_quantization": "int8"},
           against="bf16", bound=0.005),
    Format("gguf-a16", "the file's blocks, bf16 activations quantized to 15 bits a block (two int8 parts)",
           {"dtype": "bfloat16", "quantization": "gguf", "activation_quantization": "int16"},
           against="bf16", bound=0.005),
    Format("int8", "int8 weights per output channel (round to nearest), fp32 activations",
           {"dtype": "float32", "quantization": "int8"}, bound=0.02),
    Format("int8-bf16", "int8 weights, bf16 activations",
           {"dtype": "bfloat16", "quantization": "int8", "activation_quantization": "none"},
           against="bf16", bound=0.02),
    Format("int8-a8", "int8 weights, bf16 activations quantized to int8 blocks of 32 for each product",
           {"dtype": "bfloat16", "quantization": "int8", "activation_quantization": "int8"},
           against="bf16", bound=0.02),
    # The KV formats, held against fp32's full-precision KV with everything else the same.
    Format("kv-fp8", "fp8 (e4m3) KV cache, fp32 weights and activations",
           {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "fp8"}, bound=0.01, retrieval=True),
    Format("kv-int8", "int8 KV cache, fp32 weights and activations",
           {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "int8"}, bound=0.01, retrieval=True),
    Format("kv-int4", "int4 KV cache (rotated rows, a float16 scale and minimum per 16 elements), fp32 weights "
           "and activations",
           {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "int4"}, bound=0.05, retrieval=True),
    # StreamingLLM (--kv-sliding-window 256 --kv-sink-tokens 16), held against full KV: what a query
    # past 272 tokens loses is everything between the sinks and its window. Without sinks: the
    # paper's "window attention", for the long text (--long-text).
    Format("kv-window", "StreamingLLM: the last 256 tokens and 16 sinks, at their positions within the cache; "
           "fp32 weights and activations",
           {"dtype": "float32", "quantization": "none", "cache": {"sliding_window": 256, "sink_tokens": 16}},
           retrieval=True),
    Format("kv-window-nosinks", "the last 256 tokens only, at their positions within the cache; fp32",
           {"dtype": "float32", "quantization": "none", "cache": {"sliding_window": 256}}),
    # Held against the shipped model's fp32, so only a checkpoint of it is comparable: --gptq-model and
    # --awq-model give one, else the bench builds one from the HF export (round to nearest, no calibration).
    Format("gptq", "a GPTQ checkpoint of the model, fp32 activations", {"dtype": "float32", "quantization": "gptq"},
           checkpoint="gptq_model", built="gptq-sym-g32"),
    Format("awq", "an AWQ checkpoint of the model, fp32 activations", {"dtype": "float32", "quantization": "awq"},
           checkpoint="awq_model", built="awq-g32"),
)

NAMES = tuple(f.name for f in FORMATS)


def selected(names: str) -> list[Format]:
    """The formats named (comma-separated, in the table's order), the reference and the rows they are
    held against included; ValueError for an unknown name."""
    wanted = {n for n in names.split(",") if n}
    if unknown := wanted - set(NAMES):
        raise ValueError(f"unknown format {', '.join(sorted(unknown))} (choose from {', '.join(NAMES)})")
    by_name = {f.name: f for f in FORMATS}
    wanted |= {REFERENCE} | {by_name[n].against for n in wanted if by_name[n].against}
    return [f for f in FORMATS if f.name in wanted]
