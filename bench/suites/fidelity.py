"""Perplexity and greedy agreement of every weight, activation and KV-cache format against fp32.

Each format (bench/fidelity/formats.py lists them; --formats picks some) gets its own engine on the
shipped model, or on the checkpoint the format needs (given by a flag, or else built from the HF export
into bench/.cache/quant-checkpoints/), with prefix caching off, and is scored on:

- perplexity of 8 windows of 512 tokens of a fixed public-domain text committed with the bench
  (bench/texts/README.md), teacher-forced in chunks of 128 tokens, so that every chunk reads the
  ones before it back from the KV cache as decoding does;
- its rise over the row it is held against (fp32; for the GGUF blocks, the same weights dequantized
  at the same activation dtype) and issue 20's bound for it;
- greedy agreement with fp32: the first differing token of 64, for 8 prompts of 128 tokens taken
  from between the windows;
- for fp32 and the KV formats (a row's `retrieval`), long-context retrieval: a fact planted at a
  varying depth of 10 prompts of each --retrieval-lengths length, found by the greedy answer or not
  (bench/fidelity/retrieval.py). The default lengths are those where fp32 finds it in at least 8 of
  10 (docs/benchmarks.md);
- with --long-text, for fp32 and the rows with a serving window (StreamingLLM), the perplexity of each
  1,024 tokens of the whole fixed text, longer than the model's context (bench/fidelity/long_text.py).

A format this checkout's engine refuses at start-up is a skipped row carrying the engine's message;
a format that fails while it is measured is a FAILED row, and the suite exits 1.

    python -m bench fidelity [--formats fp32,bf16,gguf,...] [--threads N] [--gptq-model DIR]
                             [--awq-model DIR] [--retrieval-lengths N,...] [--long-text] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import traceback
from collections.abc import Sequence

import torch

from bench.common.engine_formats import engine_formats
from bench.common.machine import describe
from bench.common.model_quality import FIXED_TEXT, first_difference, perplexity, spans
from bench.common.paths import HF_EXPORT_DIR, QUANT_CHECKPOINTS_DIR
from bench.common.suite import begin_run, command_line, load_average, results_path, suite_parser, write_results
from bench.fidelity.formats import NAMES, REFERENCE, Format, selected
from bench.fidelity.long_text import long_text_table, segment_perplexities
from bench.fidelity.report import format_table, retrieval_table, verdict
from bench.fidelity.retrieval import PlantedPrompt, planted_prompts, retrieval_hits
from bench.suites.hf_export import ensure_export
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.paths import default_model_path
from engine.offline import generate
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from harness.quant_checkpoints import shipped_checkpoint

KV_CACHE_BYTES = 256 << 20  # room for the longest window and every greedy prompt at once, in fp32
# Where fp32 finds the planted fact in at least 8 of 10 prompts (docs/benchmarks.md, fidelity).
RETRIEVAL_LENGTHS = "256,512,768"
SIZES = ("windows", "window_tokens", "chunk_tokens", "prompts", "prompt_tokens", "tokens")


def add_size_flags(parser: argparse.ArgumentParser) -> None:
    """The sizes of the measurement (SIZES), --quick and --out: the gptq_awq suite's too."""
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--chunk-tokens", type=int, default=128, help="tokens per forward pass in a window")
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/SUITE.json, or "
                        "bench/results/smoke/ with --quick)")


def parse_sizes(parser: argparse.ArgumentParser, argv: Sequence[str], module: str) -> argparse.Namespace:
    """Parse; --quick swaps in small sizes for a smoke run; --out defaults to the suite `module`'s path."""
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.window_tokens, args.chunk_tokens = 2, 128, 64
        args.prompts, args.prompt_tokens, args.tokens = 2, 32, 16
    args.out = args.out or str(results_path(module, args.quick))
    return args


def ids_of_text() -> list[int]:
    """The fixed text as the shipped model's tokens."""
    return Tokenizer.from_path(default_model_path()).encode(FIXED_TEXT.read_text(encoding="utf-8"))


def text_spans(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """The perplexity windows and the greedy prompts, from the fixed text at the sizes in `args`."""
    ids = ids_of_text()
    return spans(ids, args.windows, args.window_tokens), spans(ids, args.prompts, args.prompt_tokens, centred=True)


def measure_long_text(args: argparse.Namespace, configs: dict[str, EngineConfig | str]) -> dict[str, list[float]]:
    """With --long-text, each row's perplexity per segment of the whole text (bench/fidelity/long_text.py);
    empty without. A row whose engine cannot be built is left out."""
    if not args.long_text:
        return {}
    ids, measured = ids_of_text(), {}
    for name, config in configs.items():
        if isinstance(config, str):
            continue
        print(f"[fidelity] {name}: long text ({len(ids)} tokens, load {load_average()})", file=sys.stderr, flush=True)
        measured[name] = segment_perplexities(config, ids)
    return measured


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --quick swaps in small sizes for a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--formats", default=",".join(NAMES), help=f"comma-separated, from {', '.join(NAMES)} "
                        f"({REFERENCE} and the rows the chosen ones are held against are always measured)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_size_flags(parser)
    built = "(default: one built from the HF export, round to nearest, in bench/.cache/quant-checkpoints/)"
    parser.add_argument("--gptq-model", default=None, help=f"a GPTQ checkpoint of the shipped model {built}")
    parser.add_argument("--awq-model", default=None, help=f"an AWQ checkpoint of the shipped model {built}")
    parser.add_argument("--retrieval-lengths", default=RETRIEVAL_LENGTHS,
                        help="prompt lengths (tokens) of the long-context retrieval check, comma-separated")
    parser.add_argument("--retrieval-prompts", type=int, default=10, help="planted-fact prompts per length")
    parser.add_argument("--long-text", action="store_true", help="also score fp32 and the serving-window rows "
                        "over the whole fixed text, past the model's context, per 1,024 tokens")
    args = parse_sizes(parser, argv, __name__)
    if args.quick:
        args.retrieval_lengths, args.retrieval_prompts = "256", 2
    try:
        args.lengths = [int(n) for n in args.retrieval_lengths.split(",")]
    except ValueError:
        parser.error(f"--retrieval-lengths: comma-separated token counts, got {args.retrieval_lengths!r}")
    try:
        args.format_list = selected(args.formats)
    except ValueError as error:
        parser.error(str(error))
    return args


def engine_config(fmt: Format, args: argparse.Namespace) -> EngineConfig | str:
    """The format's engine configuration, or why this checkout cannot build it."""
    settings, cache = dict(fmt.settings), fmt.settings.get("cache", {})
    settings.pop("cache", None)
    missing = ([name for name in settings if name not in {f.name for f in dataclasses.fields(EngineConfig)}]
               + [f"cache.{name}" for name in cache if name not in {f.name for f in dataclasses.fields(CacheConfig)}])
    if missing:
        return f"this checkout's EngineConfig has no field {', '.join(missing)}"
    model = getattr(args, fmt.checkpoint) if fmt.checkpoint else None
    if fmt.checkpoint and not model and fmt.built:
        ensure_export()
        model = str(shipped_checkpoint(fmt.built, HF_EXPORT_DIR, QUANT_CHECKPOINTS_DIR))
    try:
        return EngineConfig(model=model, cache=CacheConfig(memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=False,
                                                           **cache), **settings)
    except ValueError as refusal:
        return str(refusal)


def measure(config: EngineConfig | str, args: argparse.Namespace, windows: list[list[int]],
            prompts: list[list[int]]) -> dict:
    """The perplexity and greedy outputs of an engine built from `config` (or the reason it cannot be
    built), at the suite's sizes in `args`; or why it was skipped or failed."""
    if isinstance(config, str):
        return {"skipped": config}
    started = time.perf_counter()
    try:
        engine = Engine(config)
    except ValueError as refusal:  # the engine's start-up check: a format it has no kernel for
        return {"skipped": str(refusal)}
    formats = engine_formats(engine)
    try:
        score = perplexity(engine, windows, args.chunk_tokens)
        greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        outputs = [c.token_ids for c in generate(engine, prompts, greedy)]
    except Exception as error:  # one broken format must not hide the others' rows
        traceback.print_exc()
        return {"failed": f"{type(error).__name__}: {error}", "engine": formats}
    finally:
        del engine
        gc.collect()
    return {"perplexity": score, "greedy": outputs, "seconds": time.perf_counter() - started, "engine": formats}


def retrieval(fmt: Format, config: EngineConfig | str, outcome: dict, prompts: dict[int, list[PlantedPrompt]]) -> dict:
    """The row's hits per length (`hits`) on an engine of `config`, or why it has none: not a
    retrieval row, its engine was refused, or the check failed (`failed`)."""
    if not fmt.retrieval or "perplexity" not in outcome or isinstance(config, str):
        return {}
    try:
        found = retrieval_hits(config, prompts)
    except Exception as error:  # one broken format must not hide the others' rows
        traceback.print_exc()
        return {"failed": f"retrieval: {type(error).__name__}: {error}"}
    return {"hits": {str(length): found[length] for length in found}}


def main(argv: Sequence[str]) -> int:
    """Score every chosen format, print the table, write the results; 1 if a format failed."""
    args = parse_args(argv)
    started, load = begin_run(args.threads)
    windows, prompts = text_spans(args)
    tokenizer, filler = Tokenizer.from_path(default_model_path()), FIXED_TEXT.read_text(encoding="utf-8")
    planted = {length: planted_prompts(tokenizer, filler, length, args.retrieval_prompts) for length in args.lengths}
    results: dict[str, dict] = {}
    configs: dict[str, EngineConfig | str] = {}
    for fmt in args.format_list:
        print(f"[fidelity] {fmt.name}: {fmt.description} (load {load_average()})", file=sys.stderr, flush=True)
        config = configs[fmt.name] = engine_config(fmt, args)
        results[fmt.name] = measure(config, args, windows, prompts)
        outcome = results[fmt.name]
        print(f"[fidelity] {fmt.name}: " + (f"perplexity {outcome['perplexity']:.3f} in {outcome['seconds']:.0f} s"
                                            if "perplexity" in outcome else
                                            next(f"{k}: {v}" for k, v in outcome.items())), file=sys.stderr, flush=True)
        outcome.update(retrieval(fmt, config, outcome, planted))
        if "hits" in outcome:
            print(f"[fidelity] {fmt.name}: retrieval hits " + ", ".join(
                f"{sum(found)}/{len(found)} at {length}" for length, found in outcome["hits"].items()),
                file=sys.stderr, flush=True)
    long_text = measure_long_text(args, {fmt.name: configs[fmt.name] for fmt in args.format_list
                                         if fmt.name == REFERENCE or "cache" in fmt.settings})
    reference = results[REFERENCE].get("greedy")
    for result in results.values():
        if reference is not None and "greedy" in result:
            result["first_difference"] = [first_difference(r, o) for r, o in zip(reference, result["greedy"],
                                                                                 strict=True)]
            result["greedy_tokens"] = args.tokens
    load["end"] = load_average()
    machine = describe()
    print(format_table(args.format_list, results, args.tokens))
    print(f"\n{retrieval_table(args.format_list, results, args.lengths)}")
    if long_text:
        tokens = len(ids_of_text())
        print(f"\nPerplexity per 1,024 tokens of the whole text ({tokens} tokens):\n"
              f"{long_text_table(list(long_text), long_text, tokens - 1)}")
    print(f"\n{args.windows} windows x {args.window_tokens} tokens of {FIXED_TEXT.name}, chunks of "
          f"{args.chunk_tokens}; {args.prompts} greedy prompts x {args.prompt_tokens} tokens; "
          f"{machine['processor']} ({', '.join(machine['isa'])}), {torch.get_num_threads()} torch threads; "
          f"load average {load['start']} -> {load['end']}; retrieval: {args.retrieval_prompts} planted-fact "
          f"prompts per length")
    write_results(args.out, {
        "command": command_line(__name__, argv), "started": started, "machine": machine,
        "torch_threads": torch.get_num_threads(), "load_average": load, "text": FIXED_TEXT.name,
        "sizes": {k: getattr(args, k) for k in SIZES},
        "retrieval": {"lengths": args.lengths, "prompts": args.retrieval_prompts,
                      "codes": {length: [p.code for p in batch] for length, batch in planted.items()}},
        "formats": {f.name: {**dataclasses.asdict(f), **results[f.name], **verdict(f, results)}
                    for f in args.format_list},
        "long_text": long_text,
    })
    return 1 if any("failed" in r for r in results.values()) else 0
