"""What importance-based KV eviction under a per-request budget (--kv-budget-tokens) costs per decode
step and what it does to quality, against full KV in the same run, on the shipped model.

- Cost: --batch requests of --context-tokens prompt tokens, each generating --output-tokens (greedy,
  ignore_eos), prefix caching off: the mean time per output token after the first for full KV (the
  default attention, the CPU kernels' ops), for a budget larger than every context (the scoring
  attention alone, nothing evicted), and for budgets of each --fractions of the context; each as a
  ratio to full KV's.
- TTFT: one prompt of --context-tokens tokens alone (--ttft-runs of them, after a warm-up), its first
  token's time for full KV and for the first fraction's budget, with prompts computed in steps of
  each --ttft-chunks tokens (2048, the default --max-num-batched-tokens: one step, which scores; 256:
  the chunks before the observation window run the regular attention, engine.runner), the median
  and its ratio to full KV's, and the budgeted engine's steps by the attention they ran.
- Perplexity: --windows windows of --window-tokens tokens of the fidelity suite's fixed text, their
  first --prompt-tokens a prompt, the rest decoded one token at a time with the text's token forced
  (bench/fidelity/teacher_forced.py), so the budget evicts while decoding as it does when serving;
  full KV and each budget (a fraction of the window), and the rise over full KV.
- Retrieval: the fidelity suite's planted-fact check (bench/fidelity/retrieval.py) at each
  --retrieval-lengths length, with full KV and with each fraction of that length as the budget.

The budget's recent window is half the budget (the default) throughout; quality runs in float32
(the fidelity suite's reference), cost at --dtype.

    python -m bench kv_eviction [--threads 1] [--fractions 0.5,0.25] [--context-tokens 1024]
                                [--parts cost,ttft,quality] [--ttft-chunks 2048,256] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Sequence

import torch

from bench.common.machine import describe
from bench.common.model_quality import FIXED_TEXT, spans
from bench.common.suite import begin_run, command_line, load_average, results_path, suite_parser, write_results
from bench.fidelity.retrieval import hits, planted_prompts
from bench.fidelity.teacher_forced import forced_perplexity
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.model.paths import default_model_path
from engine.offline import generate
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

BLOCK = CacheConfig().block_size
KV_CACHE_BYTES = 256 << 20
FP32 = {"dtype": "float32", "quantization": "none", "cpu_weights": "fp32"}
PARTS = ("cost", "ttft", "quality")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in tiny sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="bfloat16", help="the model's --dtype for the cost rows")
    parser.add_argument("--fractions", default="0.5,0.25", help="budgets as fractions of the context")
    parser.add_argument("--batch", type=int, default=4, help="cost: concurrent requests")
    parser.add_argument("--context-tokens", type=int, default=1024, help="cost: prompt tokens per request")
    parser.add_argument("--output-tokens", type=int, default=32, help="cost: output tokens per request")
    parser.add_argument("--ttft-chunks", default="2048,256", help="ttft: --max-num-batched-tokens values")
    parser.add_argument("--ttft-runs", type=int, default=3, help="ttft: timed prompts per setting")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)} to run")
    parser.add_argument("--windows", type=int, default=4, help="perplexity: windows of text")
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="perplexity: each window's prompt")
    parser.add_argument("--retrieval-lengths", default="256,512,768")
    parser.add_argument("--retrieval-prompts", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/kv_eviction.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.context_tokens, args.output_tokens = 2, 128, 4
        args.ttft_chunks, args.ttft_runs = "2048,64", 1
        args.windows, args.window_tokens, args.prompt_tokens = 1, 160, 64
        args.retrieval_lengths, args.retrieval_prompts = "256", 2
    args.fraction_list = [float(f) for f in args.fractions.split(",") if f]
    args.lengths = [int(n) for n in args.retrieval_lengths.split(",") if n]
    args.chunk_list = [int(n) for n in args.ttft_chunks.split(",") if n]
    args.part_list = [part for part in args.parts.split(",") if part]
    unknown = sorted(set(args.part_list) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    args.out = args.out or str(results_path(__name__, args.quick))
    return args


def budget_of(tokens: int, fraction: float) -> int:
    """`fraction` of `tokens`, in whole blocks."""
    return max(4, round(tokens * fraction / BLOCK)) * BLOCK  # the least a default recent window allows


def _engine(settings: dict, budget: int | None, memory_bytes: int = KV_CACHE_BYTES,
            scheduler: SchedulerConfig | None = None) -> Engine:
    return Engine(EngineConfig(**settings, cache=CacheConfig(memory_bytes=memory_bytes, enable_prefix_caching=False,
                                                             budget_tokens=budget),
                               scheduler=scheduler or SchedulerConfig()))


def decode_tpot(args: argparse.Namespace, ids: list[int], budget: int | None) -> float:
    """Mean time per output token after the first, in seconds."""
    engine = _engine({"dtype": args.dtype}, budget)
    try:
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
        return statistics.mean(c.tpot_s for c in generate(engine, spans(ids, args.batch, args.context_tokens), params))
    finally:
        del engine
        gc.collect()


def cost_rows(args: argparse.Namespace, ids: list[int]) -> dict[str, dict]:
    """The cost rows: full KV, scoring alone, and each fraction's budget."""
    total = args.context_tokens + args.output_tokens
    budgets: dict[str, int | None] = {"full KV": None, "budget > context (scoring only)": budget_of(total + BLOCK, 1)}
    budgets |= {f"budget {fraction:g} x context": budget_of(args.context_tokens, fraction)
                for fraction in args.fraction_list}
    rows = {}
    for name, budget in budgets.items():
        print(f"[kv_eviction] cost: {name} (load {load_average()})", file=sys.stderr, flush=True)
        rows[name] = {"budget_tokens": budget, "tpot_s": decode_tpot(args, ids, budget)}
    base = rows["full KV"]["tpot_s"]
    return {name: {**row, "tpot_ratio": row["tpot_s"] / base} for name, row in rows.items()}


def ttft_rows(args: argparse.Namespace, ids: list[int]) -> dict[str, dict]:
    """Per chunk size: full KV's and the first fraction's budget's median TTFT of a prompt alone."""
    budget = budget_of(args.context_tokens, args.fraction_list[0])
    prompts = spans(ids, args.ttft_runs + 1, args.context_tokens)  # the first warms up
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = {}
    for chunk in args.chunk_list:
        for name, tokens in (("full KV", None), (f"budget {args.fraction_list[0]:g} x context", budget)):
            print(f"[kv_eviction] ttft: {name}, chunks of {chunk} (load {load_average()})", file=sys.stderr, flush=True)
            engine = _engine({"dtype": args.dtype}, tokens, scheduler=SchedulerConfig(max_num_batched_tokens=chunk))
            try:
                generate(engine, prompts[:1], params)
                warm = dict(engine.stats().kv_budget_steps)
                ttft = [generate(engine, [prompt], params)[0].ttft_s for prompt in prompts[1:]]
                steps = {path: count - warm.get(path, 0) for path, count in engine.stats().kv_budget_steps.items()}
            finally:
                del engine
                gc.collect()
            rows[f"{name}, chunks of {chunk}"] = {"chunk": chunk, "budget_tokens": tokens, "ttft_s": ttft,
                                                  "median_s": statistics.median(ttft), "steps": steps}
    for row in rows.values():
        base = rows[f"full KV, chunks of {row['chunk']}"]["median_s"]
        row["ratio"] = row["median_s"] / base
    return rows


def quality_rows(args: argparse.Namespace, ids: list[int]) -> dict[str, dict]:
    """Perplexity and retrieval hits for full KV and each fraction's budget."""
    windows = spans(ids, args.windows, args.window_tokens)
    tokenizer, filler = Tokenizer.from_path(default_model_path()), FIXED_TEXT.read_text(encoding="utf-8")
    planted = {length: planted_prompts(tokenizer, filler, length, args.retrieval_prompts) for length in args.lengths}
    rows = {}
    for fraction in [None, *args.fraction_list]:
        name = "full KV" if fraction is None else f"budget {fraction:g} x length"
        print(f"[kv_eviction] quality: {name} (load {load_average()})", file=sys.stderr, flush=True)
        budget = None if fraction is None else budget_of(args.window_tokens, fraction)
        engine = _engine(FP32, budget)
        try:
            row: dict = {"perplexity_budget_tokens": budget,
                         "perplexity": forced_perplexity(engine, windows, args.prompt_tokens)}
        finally:
            del engine
            gc.collect()
        row["hits"], row["retrieval_budget_tokens"] = {}, {}
        for length, prompts in planted.items():
            budget = None if fraction is None else budget_of(length, fraction)
            engine = _engine(FP32, budget)
            try:
                row["hits"][length] = sum(hits(engine, {length: prompts})[length])
                row["retrieval_budget_tokens"][length] = budget
            finally:
                del engine
                gc.collect()
        rows[name] = row
    base = rows["full KV"]["perplexity"]
    return {name: {**row, "perplexity_rise": row["perplexity"] / base - 1} for name, row in rows.items()}


def tables(args: argparse.Namespace, cost: dict[str, dict], ttft: dict[str, dict], quality: dict[str, dict]) -> str:
    """The tables of the parts that ran."""
    lines: list[str] = []
    if cost:
        lines += _cost_table(args, cost)
    if ttft:
        lines += ["", *_ttft_table(args, ttft)]
    if quality:
        lines += ["", *_quality_table(args, quality)]
    return "\n".join(lines).strip()


def _cost_table(args: argparse.Namespace, cost: dict[str, dict]) -> list[str]:
    lines = [f"| decode ({args.batch} x {args.context_tokens} context, --dtype {args.dtype}) | budget (tokens) | "
             "TPOT (ms) | vs full KV |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {row['budget_tokens'] or '-'} | {row['tpot_s'] * 1000:.2f} | {row['tpot_ratio']:.2f} |"
              for name, row in cost.items()]
    return lines


def _ttft_table(args: argparse.Namespace, ttft: dict[str, dict]) -> list[str]:
    lines = [f"| prompt alone ({args.context_tokens} tokens, --dtype {args.dtype}) | budget (tokens) | "
             f"TTFT, median of {args.ttft_runs} (ms) | vs full KV | steps regular / scored |",
             "|---|---:|---:|---:|---:|"]
    for name, row in ttft.items():
        steps = row["steps"]
        counted = f"{steps.get('regular', 0)} / {steps.get('scored', 0)}" if row["budget_tokens"] else "-"
        lines.append(f"| {name} | {row['budget_tokens'] or '-'} | {row['median_s'] * 1000:.0f} | {row['ratio']:.2f} | "
                     f"{counted} |")
    return lines


def _quality_table(args: argparse.Namespace, quality: dict[str, dict]) -> list[str]:
    lines = [f"| KV (float32) | perplexity, {args.windows} x {args.window_tokens} forced | rise | "
             + " | ".join(f"retrieval at {length}" for length in args.lengths) + " |",
             "|---|---:|---:|" + "---:|" * len(args.lengths)]
    for name, row in quality.items():
        kept = row["retrieval_budget_tokens"]
        found = " | ".join(f"{row['hits'][length]}/{args.retrieval_prompts}{_kept(kept[length])}"
                           for length in args.lengths)
        lines.append(f"| {name} | {row['perplexity']:.3f}{_kept(row['perplexity_budget_tokens'])} | "
                     f"{row['perplexity_rise'] * 100:+.2f}% | {found} |")
    return lines


def _kept(budget: int | None) -> str:
    return "" if budget is None else f" ({budget} kept)"


def main(argv: Sequence[str]) -> int:
    """The cost rows, the quality rows, the tables and the JSON results."""
    args = parse_args(argv)
    started, load = begin_run(args.threads)
    ids = Tokenizer.from_path(default_model_path()).encode(FIXED_TEXT.read_text(encoding="utf-8"))
    cost = cost_rows(args, ids) if "cost" in args.part_list else {}
    ttft = ttft_rows(args, ids) if "ttft" in args.part_list else {}
    quality = quality_rows(args, ids) if "quality" in args.part_list else {}
    load["end"] = load_average()
    machine = describe()
    print(tables(args, cost, ttft, quality))
    print(f"\n{machine['processor']} ({', '.join(machine['isa'])}), {torch.get_num_threads()} torch threads; "
          f"load average {load['start']} -> {load['end']}")
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "torch_threads": torch.get_num_threads(), "load_average": load, "cost": cost,
                             "ttft": ttft, "quality": quality})
    return 0
