"""Mixture-of-experts on CPU, each figure a ratio to a baseline of the same run, and a GPU roofline estimate.

One named shape for every measured figure (bench.moe.models.NAMED: hidden 1024, 8 layers,
8 experts top-2 of 1408 features, 16 heads / 4 KV heads, vocab 32000; --quick: a tiny one of the
same structure), random weights saved once with transformers into bench/.cache/<shape>/ (a
Mixtral model, a dense Llama twin of the same active parameters, and the Mixtral model as a GGUF
file with Q8_0 matrices written by harness.moe_gguf).

1. The MoE layer's decode step: the engine's grouped `SparseMoE` (layer 0's, as the engine builds
   it) against a per-expert torch reference (transformers' MixtralSparseMoeBlock: mask, gather,
   F.linear in fp32, index_add per expert) at each --batches, at the engine's default CPU formats
   (the HF checkpoint and a GGUF file's Q8_0 blocks as `--dtype auto` resolves them) and fp32 exact;
   target: >= 3x at batch 32 (bench.moe.steps).
2. The whole model's decode step (batch sequences of --context tokens, one new token each, then
   the logits) against the dense twin, at the same formats.
3. Tandem's engine against llama.cpp on the GGUF file, the same cores and threads, --concurrency
   prompts served together (llama.cpp through its multi-sequence batches): decode tok/s; targets
   Tandem >= 1x at 1 and >= 1.5x at 32 (this module).
4. Expert parallelism's combine on CPU (gloo): EP 2 and TP 2 against 1 process, each rank pinned
   to a core, mean greedy decode step and the all-reduces' count x their time (bench.moe.ranks).
5. An estimate, not a measurement: expert weight bytes per decode step against H100/H200 HBM and
   EP 2's combine over NVLink/InfiniBand, for the named shape and Mixtral-8x7B (bench.moe.roofline).

    python -m bench moe [--threads 2] [--batches 1,8,32] [--concurrency 1,32] [--skip steps,serving,ranks] [--quick]

Writes bench/results/moe.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from bench.common.machine import describe
from bench.common.paths import CACHE_DIR
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.llamacpp.build import build_dir, python_of, stamp_of
from bench.moe.models import MIXTRAL_8X7B, NAMED, QUICK, Checkpoints, MoEShape, ensure_checkpoints
from bench.moe.ranks import layouts_table, measure_layouts
from bench.moe.roofline import roofline, roofline_table
from bench.moe.steps import FORMATS, StepSettings, layer_table, measure_all, step_table
from bench.suites.engine_throughput import environments, run_worker

PARTS = ("steps", "serving", "ranks")  # what --skip may leave out (the roofline costs nothing)
LAYER_TARGET = (32, 3.0)  # the grouped layer at batch 32: at least 3x the reference



SYSTEMS = ("tandem", "llama.cpp")
WORKER_TIMEOUT_S = 3600
TARGETS = {1: 1.0, 32: 1.5}  # concurrency -> Tandem's decode tok/s over llama.cpp's, at least


def serving_workload(gguf: Path, vocab: int, concurrency: list[int], prompt_len: int, output_tokens: int,
                     threads: int, repeats: int) -> dict:
    """One workload file's content for both workers: distinct random prompts per case."""
    generator = torch.Generator().manual_seed(0)

    def prompts(count: int) -> list[list[int]]:
        return [torch.randint(0, vocab, (prompt_len,), generator=generator).tolist() for _ in range(count)]

    return {"model_dir": str(gguf), "gguf": str(gguf), "tandem": {}, "batched": True, "threads": threads,
            "cores": list(range(threads)), "max_model_len": prompt_len + output_tokens + 16,
            "max_num_seqs": max(concurrency), "repeats": repeats, "warmup_prompts": prompts(2),
            "cases": [{"name": f"decode_c{c}", "prompts": prompts(c), "max_tokens": output_tokens}
                      for c in concurrency]}


def commands(workload: dict, skip: list[str]) -> dict[str, list[str] | str]:
    """Each system's command line (the workload file written), or why it does not run."""
    path = CACHE_DIR / f"moe-serving-workload-t{workload['threads']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(workload), encoding="utf-8")
    folder = build_dir()
    found: dict[str, list[str] | str] = {
        "tandem": [sys.executable, "-m", "bench.throughput.systems", "tandem", "--workload", str(path)],
        "llama.cpp": ([str(python_of(folder)), "-m", "bench.llamacpp.offline", "--workload", str(path)]
                      if stamp_of(folder).exists() else
                      f"llama.cpp is not built for this CPU (python -m bench.llamacpp.build: {folder.name})"),
    }
    return {system: "skipped (--skip)" if system in skip else command for system, command in found.items()}


def run_systems(workload: dict, skip: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """Every system's result, and why each missing one gave none."""
    env, _ = environments(workload["threads"])
    results: dict[str, dict] = {}
    missing: dict[str, str] = {}
    for system, command in commands(workload, skip).items():
        if isinstance(command, str):
            missing[system] = command
            continue
        print(f"[moe] {system}, {workload['threads']} thread(s)", file=sys.stderr, flush=True)
        result, reason = run_worker(command, env, WORKER_TIMEOUT_S)
        if result is None:
            missing[system] = reason
        else:
            results[system] = result
    return results, missing


def decode_tok_s(result: dict, concurrency: int) -> float:
    """A case's decode throughput: its sequences over the time per output token after the first."""
    case = result["cases"][f"decode_c{concurrency}"]
    return concurrency / case["tpot_s"] if case["tpot_s"] > 0 else float("nan")


def serving_table(results: dict[str, dict], missing: dict[str, str], concurrency: list[int]) -> str:
    """Figure 3 as a markdown table, and the ratio of Tandem's decode tok/s to llama.cpp's."""
    lines = ["| system | concurrency | decode tok/s | time per output token (ms) | case (s) | Tandem / llama.cpp |",
             "|---|---:|---:|---:|---:|---:|"]
    for system, result in results.items():
        for c in concurrency:
            case = result["cases"][f"decode_c{c}"]
            ratio = ""
            if system == "tandem" and "llama.cpp" in results:
                value = decode_tok_s(result, c) / decode_tok_s(results["llama.cpp"], c)
                target = TARGETS.get(c)
                ratio = f"{value:.2f}x" + ("" if target is None else
                                           f" ({'meets' if value >= target else 'misses'} ≥ {target:g}x)")
            lines.append(f"| {system} | {c} | {decode_tok_s(result, c):.1f} | {case['tpot_s'] * 1e3:.2f} | "
                         f"{case['seconds']:.2f} | {ratio} |")
    lines += [f"- {system}: not run: {reason}" for system, reason in missing.items()]
    lines += [f"- {system}: {result.get('mode', '')}" for system, result in results.items()]
    if "tandem" in results:
        lines.append(f"- Tandem's formats: {results['tandem'].get('engine', {}).get('resolved', '?')}")
    return "\n".join(lines)

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in the tiny shape and few steps."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch / llama.cpp threads for figures 1-3 (cores 0..N-1)")
    parser.add_argument("--batches", default="1,8,32", help="decode batches of figures 1 and 2")
    parser.add_argument("--context", type=int, default=128, help="tokens each sequence holds in figure 2")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per figure 1/2 entry (median)")
    parser.add_argument("--concurrency", default="1,32", help="prompts served together in figure 3")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens in figures 3 and 4")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens generated per prompt in figure 3")
    parser.add_argument("--serving-repeats", type=int, default=2, help="runs of each figure 3 case (the fastest)")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps in figure 4")
    parser.add_argument("--rank-weights", default="fp16", choices=["fp16", "fp32"],
                        help="figure 4's float32 weights as the engine holds them (fp16: --dtype auto's)")
    parser.add_argument("--skip", default="", help=f"comma-separated parts not to run, from {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="the tiny shape, few repeats and steps (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.context, args.repeats, args.prompt_len, args.output_tokens = 32, 3, 16, 8
        args.serving_repeats, args.steps = 1, 4
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.concurrency_list = [int(c) for c in args.concurrency.split(",")]
    args.skip_list = [s for s in args.skip.split(",") if s]
    if unknown := set(args.skip_list) - set(PARTS):
        parser.error(f"unknown --skip {', '.join(sorted(unknown))}")
    return args


def _print(title: str, body: str) -> None:
    print(f"\n## {title}\n\n{body}", flush=True)


def _steps(args: argparse.Namespace, paths: Checkpoints, results: dict) -> None:
    """Figures 1 and 2, in this process on cores 0..threads-1."""
    os.sched_setaffinity(0, set(range(args.threads)))
    torch.set_num_threads(args.threads)
    figures = measure_all(paths, StepSettings(args.batch_list, args.context, args.repeats), list(FORMATS))
    results["steps"] = figures
    batch, target = LAYER_TARGET
    _print(f"1. MoE layer decode step, grouped against per-expert ({args.threads} threads)",
           layer_table(figures, batch, target) + "\n\n"
           + "\n".join(f"- {label}: {f['resolved']}" for label, f in figures["formats"].items()))
    _print(f"2. Model decode step, MoE against the dense twin ({args.context}-token contexts, {args.threads} threads)",
           step_table(figures))


def _serving(args: argparse.Namespace, shape: MoEShape, paths: Checkpoints, results: dict) -> None:
    """Figure 3, in worker subprocesses."""
    served = paths.gguf.name if paths.gguf else "the GGUF file"
    title = f"3. Tandem against llama.cpp on {served} ({args.threads} threads)"
    if paths.gguf is None:
        results["serving"] = {"missing": "harness.moe_gguf is missing: no GGUF file to serve"}
        _print(title, results["serving"]["missing"])
        return
    workload = serving_workload(paths.gguf, shape.vocab, args.concurrency_list, args.prompt_len, args.output_tokens,
                                args.threads, args.serving_repeats)
    systems, missing = run_systems(workload, [])
    results["serving"] = {"systems": systems, "missing": missing,
                          "decode_tok_s": {system: {str(c): decode_tok_s(result, c) for c in args.concurrency_list}
                                           for system, result in systems.items()}}
    _print(title + f": {args.prompt_len}-token prompts, {args.output_tokens} output tokens, greedy",
           serving_table(systems, missing, args.concurrency_list))


def _ranks(args: argparse.Namespace, paths: Checkpoints, results: dict) -> None:
    """Figure 4, in spawned rank processes."""
    prompt = torch.randint(0, 256, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    figures = measure_layouts(str(paths.moe), args.rank_weights, prompt, args.steps,
                              results_path(__name__, args.quick, suffix=".rank0.pt"))
    results["ranks"] = figures
    _print(f"4. Expert parallelism's combine on CPU (gloo, one core and thread per rank, float32, "
           f"{args.rank_weights} weights; {args.prompt_len}-token prompt, {args.steps} greedy steps, batch 1)",
           layouts_table(figures))


def _roofline(results: dict) -> None:
    """Figure 5: arithmetic only, for the named shape and Mixtral-8x7B whatever the run's shape."""
    shapes = [NAMED, MIXTRAL_8X7B]
    results["roofline_estimate"] = [asdict(row) for row in roofline(shapes)]
    _print("5. GPU roofline (estimate, not measured): expert weights per decode step, bf16, uniform routing; "
           "EP 2 combine = ring all-reduce of [batch, hidden] bf16 per layer plus an assumed per-call latency "
           "(NVLink 10 µs, InfiniBand 20 µs)",
           roofline_table(shapes) + "\n- Mixtral-8x7B's bf16 weights (93 GB) do not fit one H100 (80 GB): its "
           "1-GPU H100 row is the bandwidth floor, not a deployable layout.")


def main(argv: Sequence[str]) -> int:
    """Every figure not skipped, the tables, the JSON results."""
    args = parse_args(argv)
    shape = QUICK if args.quick else NAMED
    machine = describe()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load = {"start": load_average()}
    print(f"# MoE on {machine['processor']} ({', '.join(machine['isa'])}; {machine['cpus']} CPUs)\n\n"
          f"shape {shape.describe()}", flush=True)
    print(f"[moe] checkpoints for {shape.name} (made once)", file=sys.stderr, flush=True)
    paths = ensure_checkpoints(shape)
    results: dict = {"command": command_line(__name__, argv), "started": started, "machine": machine,
                     "settings": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
                     "shape": asdict(shape), "checkpoints": {k: str(v) for k, v in asdict(paths).items()}}
    if "steps" not in args.skip_list:
        _steps(args, paths, results)
    if "serving" not in args.skip_list:
        load["before serving"] = load_average()
        _serving(args, shape, paths, results)
    if "ranks" not in args.skip_list:
        load["before ranks"] = load_average()
        _ranks(args, paths, results)
    _roofline(results)
    load["end"] = load_average()
    results["load_average"] = load
    print(f"\n- {machine['processor']}; load average: " + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(results_path(__name__, args.quick), results)
    return 0
