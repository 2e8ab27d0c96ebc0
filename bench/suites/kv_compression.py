"""What each KV format costs and buys against bf16 KV, in one run: KV bytes per token, decode TPOT at
a fixed batch and long-prompt throughput under one KV budget in bytes.

Every format runs the shipped model at one --dtype (bfloat16 by default, so "auto" KV is bf16 KV,
the reference), one engine after another in this process, prefix caching off:

- KV bytes per token: computed from the format's page bytes (engine.kv_cache.codec), every layer's
  K and V, scales included; no timing;
- decode TPOT: --batch requests of --prompt-tokens tokens, each generating --output-tokens (greedy,
  ignore_eos), with a KV budget that holds them all: the mean time per output token after the first;
- long-prompt throughput: --long-requests requests of --long-tokens prompt tokens and
  --long-output-tokens output tokens in --kv-cache-mib of KV: prompt and output tokens per second
  of wall time. The budget is the same bytes for every format, so a smaller page holds more of the
  requests at once: what compression is for.

Each figure is also given as a ratio to bf16 KV's in the same run (TPOT: bf16's / the format's, so
above 1 is faster). Rows of other compression policies (a sliding window, eviction) are EngineConfig
fields, as the fidelity suite's rows are: add them to ROWS.

    python -m bench kv_compression [--formats auto,fp8_e4m3,int8,int4] [--dtype bfloat16] [--threads N]
                                   [--batch 16] [--long-tokens 2048] [--kv-cache-mib 64] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from bench.common.machine import describe
from bench.common.model_quality import FIXED_TEXT, spans
from bench.common.suite import begin_run, command_line, load_average, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.cache_engine import bytes_per_block
from engine.model.paths import default_model_path
from engine.offline import generate
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

REFERENCE = "auto"  # the model's dtype: bf16 KV at the default --dtype
ROWS = ("auto", "fp8_e4m3", "int8", "int4")  # --kv-cache-dtype values


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in tiny sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--formats", default=",".join(ROWS), help=f"comma-separated --kv-cache-dtype values "
                        f"(from {', '.join(ROWS)}; {REFERENCE}, the reference, is always measured)")
    parser.add_argument("--dtype", default="bfloat16", help="the model's --dtype for every row")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=16, help="decode: concurrent requests")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="decode: prompt tokens per request")
    parser.add_argument("--output-tokens", type=int, default=64, help="decode: output tokens per request")
    parser.add_argument("--long-requests", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=2048, help="long prompts: prompt tokens per request")
    parser.add_argument("--long-output-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="long prompts: every format's KV budget")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/kv_compression.json, "
                        "or bench/results/smoke/ with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.prompt_tokens, args.output_tokens = 2, 32, 8
        args.long_requests, args.long_tokens, args.long_output_tokens, args.kv_cache_mib = 2, 256, 4, 8
    args.format_list = [REFERENCE, *(f for f in args.formats.split(",") if f and f != REFERENCE)]
    if unknown := set(args.format_list) - set(ROWS):
        parser.error(f"--formats: unknown {', '.join(sorted(unknown))} (choose from {', '.join(ROWS)})")
    args.out = args.out or str(results_path(__name__, args.quick))
    return args


def _engine(args: argparse.Namespace, kv_cache_dtype: str, cache: CacheConfig) -> Engine:
    return Engine(EngineConfig(dtype=args.dtype, kv_cache_dtype=kv_cache_dtype, cache=cache))


def measure(args: argparse.Namespace, kv_cache_dtype: str, ids: list[int]) -> dict:
    """One format's figures: KV bytes per token, decode TPOT (s) and long-prompt tokens per second."""
    short = spans(ids, args.batch, args.prompt_tokens)
    long = spans(ids, args.long_requests, args.long_tokens)
    # Blocks for the whole decode batch whatever the format: no request waits or is preempted.
    block_size = CacheConfig().block_size
    blocks = args.batch * (blocks_for(args.prompt_tokens + args.output_tokens, block_size) + 1)
    engine = _engine(args, kv_cache_dtype, CacheConfig(num_blocks=blocks, enable_prefix_caching=False))
    try:
        kv_format = engine.kv_format.name
        kv_bytes = bytes_per_block(engine.model_config, block_size, engine.kv_format) / block_size
        decode = generate(engine, short, SamplingParams(max_tokens=args.output_tokens, temperature=0.0,
                                                        ignore_eos=True))
        tpot = statistics.mean(c.tpot_s for c in decode)
    finally:
        del engine
        gc.collect()
    engine = _engine(args, kv_cache_dtype, CacheConfig(memory_bytes=args.kv_cache_mib << 20,
                                                       enable_prefix_caching=False))
    try:
        started = time.perf_counter()
        generate(engine, long, SamplingParams(max_tokens=args.long_output_tokens, temperature=0.0, ignore_eos=True))
        elapsed = time.perf_counter() - started
        blocks = engine.kv.num_blocks
    finally:
        del engine
        gc.collect()
    tokens = args.long_requests * (args.long_tokens + args.long_output_tokens)
    return {"kv_format": kv_format, "kv_bytes_per_token": kv_bytes, "decode_tpot_s": tpot,
            "long_tokens_per_s": tokens / elapsed, "long_kv_blocks": blocks}


def with_ratios(rows: dict[str, dict]) -> dict[str, dict]:
    """Each row with its figures as ratios to the reference row's (TPOT inverted: above 1 is faster)."""
    ref = rows[REFERENCE]
    return {name: {**row, "bytes_ratio": row["kv_bytes_per_token"] / ref["kv_bytes_per_token"],
                   "tpot_speedup": ref["decode_tpot_s"] / row["decode_tpot_s"],
                   "long_throughput_ratio": row["long_tokens_per_s"] / ref["long_tokens_per_s"]}
            for name, row in rows.items()}


def format_table(rows: dict[str, dict], args: argparse.Namespace) -> str:
    """One line per format: each figure and its ratio to bf16 KV's."""
    lines = [f"| KV format | bytes/token | vs {REFERENCE} | TPOT at batch {args.batch} (ms) | speed-up | "
             f"long prompts ({args.long_requests} x {args.long_tokens}) tok/s | vs {REFERENCE} | KV blocks in "
             f"{args.kv_cache_mib} MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        label = name if name == row["kv_format"] else f"{name} ({row['kv_format']})"
        lines.append(f"| {label} | {row['kv_bytes_per_token']:.0f} | {row['bytes_ratio']:.3f} | "
                     f"{row['decode_tpot_s'] * 1000:.2f} | {row['tpot_speedup']:.2f} | "
                     f"{row['long_tokens_per_s']:.0f} | {row['long_throughput_ratio']:.2f} | {row['long_kv_blocks']} |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """Every chosen format, then the table and the JSON results."""
    args = parse_args(argv)
    started, load = begin_run(args.threads)
    ids = Tokenizer.from_path(default_model_path()).encode(FIXED_TEXT.read_text(encoding="utf-8"))
    rows: dict[str, dict] = {}
    for name in args.format_list:
        print(f"[kv_compression] {name} (load {load_average()})", file=sys.stderr, flush=True)
        rows[name] = measure(args, name, ids)
    rows = with_ratios(rows)
    load["end"] = load_average()
    machine = describe()
    print(format_table(rows, args))
    print(f"\n--dtype {args.dtype}; {machine['processor']} ({', '.join(machine['isa'])}), {torch.get_num_threads()} "
          f"torch threads; load average {load['start']} -> {load['end']}")
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "torch_threads": torch.get_num_threads(), "load_average": load, "rows": rows})
    return 0
