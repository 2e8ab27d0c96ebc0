"""Prompt compute with and without fbgemm's fp16 product, in one process, alternated prompt by prompt.

From one load of the shipped model, on one torch thread (the row limit it alternates,
engine.model.product_plan.FP16_MAX_ROWS, is the one-thread limit; each engine's products are planned
with it at load), prefix caching off: an engine serving
the GGUF file's own blocks (`--quantization gguf`) and one serving them dequantized (`none`), both
with `--cpu-weights fp16`. Each distinct prompt of each `--tokens` length is computed (first token
only) by each engine with the fp16 product's row limit at each of `--limits`, and, for the gguf
engine, also with `--cpu-weights fp32`, i.e. the exact path: dequantize each weight and torch's
fp32 GEMM. It prints the median prompt tokens/s of each, the first prompt left out as warm-up.

    python -m bench prompt_fp16 [--tokens 192,512,1024] [--prompts 5] [--limits 512,4096]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from bench.harness.machine import describe
from bench.harness.model_quality import document_windows
from bench.harness.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model import product_plan
from engine.model.loader import load_model_files
from engine.offline import generate
from engine.sampling_params import SamplingParams

ENGINES = {  # label -> EngineConfig fields
    "gguf, exact (dequantize + fp32 GEMM)": {"quantization": "gguf", "cpu_weights": "fp32"},
    "gguf, fp16 copy": {"quantization": "gguf", "cpu_weights": "fp16"},
    "none, fp16 weights": {"quantization": "none", "cpu_weights": "fp16"},
}


def main(argv: Sequence[str]) -> int:
    """Alternate the engines and row limits prompt by prompt; print and write the medians."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--tokens", default="192,512,1024", help="comma-separated prompt lengths")
    parser.add_argument("--prompts", type=int, default=5, help="distinct prompts per length (the first warms up)")
    parser.add_argument("--limits", default="512,4096", help="comma-separated FP16_MAX_ROWS values to alternate")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    limits = [int(v) for v in args.limits.split(",")]
    torch.set_num_threads(1)
    files = load_model_files(None, torch.float32)
    cache = CacheConfig(enable_prefix_caching=False)
    # (row label, engine, row limit): the limit only matters to engines holding fp16 weights.
    runs = []
    saved = product_plan.FP16_MAX_ROWS
    for label, fields in ENGINES.items():
        fp16 = fields["cpu_weights"] == "fp16"
        for limit in limits if fp16 else limits[:1]:
            product_plan.FP16_MAX_ROWS = limit  # read as each product is planned, at load
            try:
                engine = Engine(EngineConfig(cache=cache, **fields), files=files)  # type: ignore[arg-type]
            finally:
                product_plan.FP16_MAX_ROWS = saved
            runs.append((f"{label}, limit {limit}" if fp16 else label, engine))
    print(f"CPU: {describe()}, 1 thread, load average {load_average()}")
    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    results: dict[str, dict[str, float]] = {}
    for tokens in (int(v) for v in args.tokens.split(",")):
        prompts = document_windows(runs[0][1], args.prompts, tokens)
        times: dict[str, list[float]] = {}
        for prompt in prompts:
            for key, engine in runs:
                started = time.perf_counter()
                generate(engine, [prompt], first_token)
                times.setdefault(key, []).append(time.perf_counter() - started)
        results[str(tokens)] = {key: tokens / statistics.median(t[1:]) for key, t in times.items()}
        print(f"{tokens}-token prompts, tokens/s: "
              + "; ".join(f"{key} {rate:.0f}" for key, rate in results[str(tokens)].items()), flush=True)
    write_results(args.out, {"command": command_line(__name__, argv), "cpu": describe(), "results": results})
    return 0
