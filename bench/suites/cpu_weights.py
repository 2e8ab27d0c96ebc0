"""What holding the weights at fp16 (EngineConfig.cpu_weights="fp16") buys and costs on CPU.

Builds the shipped model twice from one load, one torch thread, no prefix cache: with exact fp32
weights pre-packed for oneDNN ("fp32", the format served before fp16) and with weights rounded to
fp16 for fbgemm's fp16-weight product ("fp16"). For each, in the same run:

- decode step: mean time per output token of `--batch` requests of 256-token prompts decoding
  64 tokens together, for each batch size;
- prefill: mean time of one 256-token prompt (its first token);
- perplexity of eight 512-token windows of README + architecture.md (teacher-forced);
- greedy agreement with fp32: the index of the first differing token over 48, six prompts.

    python -m bench cpu_weights [--batch 1,4,8] [--out bench/results/cpu_weights.json]
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from bench.common.model_quality import document_windows, first_difference, perplexity
from bench.common.suite import command_line, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.loader import load_model_files
from engine.offline import generate
from engine.sampling_params import SamplingParams

PROMPT_TOKENS = 256
DECODE_TOKENS = 64
AGREEMENT_TOKENS = 48
WINDOW_TOKENS = 512
FORMATS = ("fp32", "fp16")


def _decode_step_ms(engine: Engine, prompts: list[list[int]], batch: int) -> float:
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    completions = generate(engine, prompts[:batch], params)
    return 1000 * sum(c.tpot_s for c in completions) / len(completions)


def _prefill_ms(engine: Engine, prompts: list[list[int]]) -> float:
    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    started = time.perf_counter()
    for prompt in prompts:
        generate(engine, [prompt], first_token)
    return 1000 * (time.perf_counter() - started) / len(prompts)


def measure(engine: Engine, batches: list[int]) -> dict:
    """One format's figures (greedy outputs included, for the agreement against fp32)."""
    prompts = document_windows(engine, max(8, *batches), PROMPT_TOKENS)
    generate(engine, prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    greedy = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True)
    return {
        "decode_step_ms": {str(batch): _decode_step_ms(engine, prompts, batch) for batch in batches},
        "prefill_ms": _prefill_ms(engine, prompts[:4]),
        "perplexity": perplexity(engine, document_windows(engine, 8, WINDOW_TOKENS)),
        "greedy": [c.token_ids for c in generate(engine, prompts[:6], greedy)],
    }


def main(argv: Sequence[str]) -> int:
    """Measure both formats from one load, print the table, write the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--batch", default="1,4,8", help="comma-separated decode batch sizes")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    torch.set_num_threads(1)
    files = load_model_files(None, torch.float32)
    results: dict[str, dict] = {}
    for fmt in FORMATS:
        # quantization none: the formats of the dequantized weights (the file's blocks: weight_formats).
        engine = Engine(EngineConfig(cpu_weights=fmt, quantization="none",
                                     cache=CacheConfig(enable_prefix_caching=False)), files=files)
        results[fmt] = measure(engine, batches)
        del engine
    reference = results["fp32"]["greedy"]
    for fmt in FORMATS:
        figures = results[fmt]
        figures["first_difference"] = [first_difference(r, o) for r, o in zip(reference, figures.pop("greedy"),
                                                                              strict=True)]
    print("| figure | fp32 (oneDNN) | fp16 (fbgemm) | fp32 / fp16 |")
    print("|---|---:|---:|---:|")
    for batch in map(str, batches):
        a, b = results["fp32"]["decode_step_ms"][batch], results["fp16"]["decode_step_ms"][batch]
        print(f"| decode step, batch {batch}, ms | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    a, b = results["fp32"]["prefill_ms"], results["fp16"]["prefill_ms"]
    print(f"| prefill, one {PROMPT_TOKENS}-token prompt, ms | {a:.0f} | {b:.0f} | {a / b:.2f}x |")
    a, b = results["fp32"]["perplexity"], results["fp16"]["perplexity"]
    print(f"| perplexity, 8 x {WINDOW_TOKENS} tokens | {a:.3f} | {b:.3f} | {b / a - 1:+.3%} |")
    print(f"| greedy agrees with fp32 for (of {AGREEMENT_TOKENS}) | | {results['fp16']['first_difference']} | |")
    write_results(args.out, {"command": command_line(__name__, argv), "results": results})
    return 0

