"""Issue 17's draft proposers: batch-1 decode speed on chat prompts with each proposer, against the
same target without speculation, for a float32 target (exact weights) and the default formats.

Proposers: a self-draft (the target's own GGUF file in the formats `auto` picks: its 4-bit blocks,
bf16 activations where the CPU has them), early exits of that draft after its first N layers, and
n-gram lookup for comparison. Each row: decode tok/s (output tokens after the first over the time
after the first, summed over the prompts), the ratio to the same target alone, the acceptance, and
the median gap from the first token to the second: the step where the draft first computes the
prompt's KV itself (on a decode worker: the price of not shipping the draft's KV too).
In-process engines on `--threads` torch threads, greedy, max_tokens 128, prefix caching off.

    python -m bench draft_models [--threads 1] [--prompts 6] [--repeats 2] [--layers 10,20]
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.suites.speculative import chat, closed_loop
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.speculative.config import SpeculativeConfig
from services.common.malloc_arenas import limit_malloc_arenas

TARGETS = {"float32": {"dtype": "float32", "quantization": "none", "cpu_weights": "fp32"}, "default": {}}


def proposers(layers: Sequence[int]) -> dict[str, SpeculativeConfig | None]:
    """The configurations compared, the target alone first."""
    configs: dict[str, SpeculativeConfig | None] = {
        "none": None,
        "self-draft k4": SpeculativeConfig(method="draft_model", num_speculative_tokens=4, disable_by_batch_size=None),
        "ngram k8": SpeculativeConfig(disable_by_batch_size=None),
    }
    for n in layers:
        configs[f"self-draft {n} layers k4"] = SpeculativeConfig(method="draft_model", num_speculative_tokens=4,
                                                                 draft_layers=n, disable_by_batch_size=None)
    return configs


def main(argv: Sequence[str]) -> int:
    """Every proposer on every target, alternately per repeat; the table and the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", default="10,20", help="early exits of the self-draft to try")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    limit_malloc_arenas()
    torch.set_num_threads(args.threads)
    configs = proposers([int(n) for n in args.layers.split(",") if n])
    runs: dict[str, dict[str, list[dict]]] = {}
    formats: dict[str, str] = {}
    for target, fmt in TARGETS.items():
        engines = {name: Engine(EngineConfig(cache=CacheConfig(enable_prefix_caching=False), speculative=spec, **fmt))
                   for name, spec in configs.items()}
        formats[target] = engines["none"].formats.describe()
        prompts = chat(engines["none"], args.prompts)
        for engine in engines.values():
            closed_loop(engine, prompts[:1], 1)  # warm-up
        runs[target] = {name: [] for name in engines}
        for repeat in range(args.repeats):
            for name, engine in engines.items():
                result = closed_loop(engine, prompts, 1)
                runs[target][name].append(result)
                print(f"[draft_models] {target} target, {name}, run {repeat + 1}: decode {result['decode_tok_s']:.1f} "
                      f"tok/s, accepted {result['accepted_tokens']}/{result['draft_tokens']}", flush=True)
        del engines
    machine = describe()
    print(f"\n{machine['processor']} ({', '.join(machine['isa'])}), {args.threads} thread(s)")
    for target in TARGETS:
        print(f"- {target} target: {formats[target]}")
    print("\n| target | proposer | decode tok/s | vs the target alone | acceptance | 1st→2nd token ms |")
    print("|---|---|---:|---:|---:|---:|")
    for target, by_name in runs.items():
        base = statistics.median(r["decode_tok_s"] for r in by_name["none"])
        for name, results in by_name.items():
            speed = statistics.median(r["decode_tok_s"] for r in results)
            drafted = sum(r["draft_tokens"] for r in results)
            accepted = sum(r["accepted_tokens"] for r in results)
            rate = f"{accepted / drafted:.0%} of {drafted}" if drafted else "-"
            gap = statistics.median(r["second_token_ms"] for r in results)
            print(f"| {target} | {name} | {speed:.1f} | {speed / base:.2f}x | {rate} | {gap:.0f} |")
    write_results(args.out, {"command": command_line(__name__, argv), "machine": machine, "load": load_average(),
                             "threads": args.threads, "formats": formats,
                             "configs": {name: vars(spec) if spec else None for name, spec in configs.items()},
                             "runs": runs})
    return 0
