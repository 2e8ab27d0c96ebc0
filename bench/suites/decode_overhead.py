"""Where a batch-1 decode step's time goes: inside torch's ops (the kernels) and outside them
(Python, scheduling, detokenizing, the dispatch between ops).

One engine on the shipped GGUF at this checkout's defaults (or the --dtype, --quantization,
--kv-cache-dtype, --cpu-weights given), one request of a 128-token prompt, greedy with ignore_eos.
Per thread count, after warm-up steps: `--steps` decode steps (`Engine.step()`, the whole step a
serving worker runs) timed plain, then as many under torch.profiler (CPU). From the profile: the
self time of every op (namespace::name, so nested ops are counted once), the op count, the top ops.
Outside the ops = the plain step's wall time − the ops' self time per step (the profiler's own cost
inflates only the profiled wall time, which is reported beside it). Each op also pays torch's
dispatch inside its self time: the count times the cost of a trivial op estimates that part.

    python -m bench decode_overhead [--threads 1,2] [--steps 64] [--dtype D] [--quantization Q] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common.engine_formats import FORMAT_FIELDS, engine_formats
from bench.common.machine import describe
from bench.common.model_quality import FIXED_TEXT, spans
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

PROMPT_TOKENS = 128
WARMUP_STEPS = 8
TOP_OPS = 12


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in small sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed, and as many profiled")
    for name in FORMAT_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", default=None, help=f"EngineConfig.{name} (default: "
                            "the engine's)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/decode_overhead.json, "
                        "or bench/results/smoke/ with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 8
    args.thread_list = [int(t) for t in args.threads.split(",")]
    args.out = args.out or str(results_path(__name__, args.quick))
    return args


def trivial_op_us(repeats: int = 20000) -> float:
    """Microseconds one call of a one-element op costs: torch's dispatch with next to no kernel."""
    x = torch.ones(1)
    with torch.inference_mode():
        started = time.perf_counter()
        for _ in range(repeats):
            torch.add(x, x)
        return (time.perf_counter() - started) / repeats * 1e6


def _steps(engine: Engine, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - started)
    return seconds


def measure(engine: Engine, prompt: list[int], steps: int) -> dict:
    """One request's decode steps: plain wall times, then a profile of as many more."""
    params = SamplingParams(max_tokens=WARMUP_STEPS + 2 * steps + 2, temperature=0.0, ignore_eos=True)
    engine.add_request(f"overhead-{time.monotonic_ns()}", prompt, params)
    engine.step()  # the prefill
    _steps(engine, WARMUP_STEPS)
    plain = _steps(engine, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = _steps(engine, steps)
    while engine.has_unfinished():
        engine.step()
    ops = [event for event in prof.key_averages() if "::" in event.key]
    self_us = sum(event.self_cpu_time_total for event in ops) / steps
    calls = sum(event.count for event in ops) / steps
    wall_ms = statistics.median(plain) * 1e3
    top = sorted(ops, key=lambda event: event.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return {
        "step_ms": wall_ms, "step_ms_mean": statistics.fmean(plain) * 1e3,
        "profiled_step_ms": statistics.median(profiled) * 1e3, "ops_self_ms": self_us / 1e3,
        "outside_ops_ms": wall_ms - self_us / 1e3, "ops_per_step": calls,
        "top_ops": [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / steps / 1e3,
                     "calls_per_step": e.count / steps} for e in top],
    }


def main(argv: Sequence[str]) -> int:
    """Measure at every thread count; print the table; write the results."""
    args = parse_args(argv)
    settings = {name: getattr(args, name) for name in FORMAT_FIELDS if getattr(args, name) is not None}
    try:
        config = EngineConfig(cache=CacheConfig(memory_bytes=64 << 20, enable_prefix_caching=False), **settings)
        engine = Engine(config)
    except ValueError as refusal:
        print(f"python -m bench decode_overhead: {refusal}", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load = {"start": load_average()}
    prompt = spans(engine.tokenizer.encode(FIXED_TEXT.read_text(encoding="utf-8")), 1, PROMPT_TOKENS)[0]
    runs = {}
    for threads in args.thread_list:
        torch.set_num_threads(threads)
        runs[threads] = {**measure(engine, prompt, args.steps), "trivial_op_us": trivial_op_us()}
    load["end"] = load_average()
    chosen = engine_formats(engine)
    print("| threads | decode step, ms (median) | in ops (self time), ms | outside ops, ms | ops per step | "
          "dispatch estimate (ops x trivial op), ms | profiled step, ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for threads, run in runs.items():
        dispatch = run["ops_per_step"] * run["trivial_op_us"] / 1e3
        print(f"| {threads} | {run['step_ms']:.1f} | {run['ops_self_ms']:.1f} | {run['outside_ops_ms']:.1f} | "
              f"{run['ops_per_step']:.0f} | {dispatch:.1f} | {run['profiled_step_ms']:.1f} |")
    for threads, run in runs.items():
        print(f"\ntop ops, {threads} thread(s): " + "; ".join(
            f"{op['op']} {op['self_ms_per_step']:.2f} ms x{op['calls_per_step']:.0f}" for op in run["top_ops"][:6]))
    machine = describe()
    print(f"\nengine: {chosen}; {machine['processor']} ({', '.join(machine['isa'])}); load average "
          f"{load['start']} -> {load['end']}")
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "engine": chosen, "load_average": load, "steps": args.steps,
                             "runs": {str(t): r for t, r in runs.items()}})
    return 0
