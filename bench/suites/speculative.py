"""Issue 17's speed ratios: n-gram speculative decoding against Tandem's default (no speculation),
same engine formats, same run, alternately.

- batch 1 on the input-grounded workload (bench/texts/input-grounded-prompts.json: copying tasks
  over Jargon File passages, chat-rendered): decode tok/s of each request (its output tokens after
  the first over the time after the first), the sum over the sum; target >= 2x;
- batch 1 on chat prompts (the goodput benchmark's ShareGPT workload), the same figure: what
  speculation does where outputs copy little;
- the concurrency curve, 1 to 32 requests in flight (closed loop) on the input-grounded prompts at
  the shipped `disable_by_batch_size`: output tok/s; target never below 0.95x.

With `--mesh` the same cases run through a mesh instead (bench/common/speculative_mesh.py: a decode
worker with `--speculative-config` against one without, through a gateway's OpenAI API each, greedy,
ignore_eos, `--max-tokens` 64 unless given); targets: batch 1 input-grounded >= 1.5x, every case >= 1.0x.

Acceptance per workload (accepted / drafted tokens, and per draft position) comes with each row.
In-process engines on `--threads` torch threads, greedy, max_tokens 128 (ignore_eos off: outputs
end where the model stops), prefix caching off.

    python -m bench speculative [--threads 1] [--config JSON] [--concurrency 1,2,4,8,16,32] [--repeats 2]
                                [--mesh] [--max-tokens N]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common.machine import describe
from bench.common.speculative_mesh import SpeculativeMesh
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.common.workload import build_workload
from engine.compose import build_engine
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.loader import load_model_files
from engine.model.paths import default_model_path
from engine.sampling_params import SamplingParams
from engine.speculative.config import SpeculativeConfig
from engine.tokenizer import Tokenizer
from services.common.malloc_arenas import limit_malloc_arenas

PROMPTS = Path(__file__).resolve().parents[1] / "texts" / "input-grounded-prompts.json"
MAX_TOKENS = 128


def input_grounded(tokenizer: Tokenizer) -> list[list[int]]:
    """The committed copying tasks, chat-rendered."""
    data = json.loads(PROMPTS.read_text(encoding="utf-8"))
    return [tokenizer.encode_chat([{"role": "user", "content": f"{p['task']}\n\n{p['passage']}"}])
            for p in data["prompts"]]


def chat(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """ShareGPT-style chat prompts of the goodput workload."""
    workload = build_workload(count, 0, lambda text: tokenizer.encode(text, add_special_tokens=False),
                              tokenizer.decode)
    return [tokenizer.encode_chat([{"role": "user", "content": r.prompt}]) for r in workload.requests]


def closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int = MAX_TOKENS) -> dict:
    """Every prompt once, `concurrency` in flight; output tok/s overall, decode tok/s per request, and the
    median gap from each request's first token to its second (the step where a draft model first
    computes the request's prompt)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stats = engine.scheduler.spec_stats
    before = stats.snapshot()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    second: dict[str, float] = {}
    tokens: dict[str, int] = {}
    added = 0
    start = time.perf_counter()
    while added < len(prompts) or engine.has_unfinished():
        while added < len(prompts) and engine.scheduler.num_running + engine.scheduler.num_waiting < concurrency:
            engine.add_request(f"r{added}", prompts[added], params)
            added += 1
        for output in engine.step():
            now = time.perf_counter()
            first.setdefault(output.request_id, now)
            last[output.request_id] = now
            if output.num_output_tokens > 1:
                second.setdefault(output.request_id, now)
            tokens[output.request_id] = output.num_output_tokens
    elapsed = time.perf_counter() - start
    decode_tokens = sum(n - 1 for n in tokens.values())
    decode_s = sum(last[r] - first[r] for r in tokens)
    return {"output_tok_s": sum(tokens.values()) / elapsed, "decode_tok_s": decode_tokens / decode_s,
            "output_tokens": sum(tokens.values()),
            "second_token_ms": 1e3 * statistics.median(second[r] - first[r] for r in second) if second else None,
            "drafts": stats.num_drafts - before.num_drafts,
            "draft_tokens": stats.num_draft_tokens - before.num_draft_tokens,
            "accepted_tokens": stats.num_accepted_tokens - before.num_accepted_tokens,
            "accepted_per_position": [n - (before.accepted_per_position[i] if i < len(before.accepted_per_position)
                                           else 0) for i, n in enumerate(stats.accepted_per_position)]}


def cases(tokenizer: Tokenizer, chat_prompts: int, levels: Sequence[int]) -> list[tuple[str, list[list[int]], int]]:
    """(name, prompts, concurrency): batch 1 on both workloads, then the curve."""
    grounded = input_grounded(tokenizer)
    found = [("batch-1 input-grounded", grounded, 1), ("batch-1 chat", chat(tokenizer, chat_prompts), 1)]
    # The curve: enough requests that every level runs full for most of its time.
    return found + [(f"c{c} input-grounded", (grounded * -(-max(2 * c, 12) // len(grounded)))[: max(2 * c, 12)], c)
                    for c in levels if c > 1]


def main(argv: Sequence[str]) -> int:
    """Both systems on each case, alternately; the tables and the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--config", default="{}", help="--speculative-config of the speculating engine")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--chat-prompts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mesh", action="store_true", help="through a mesh's decode workers and gateways")
    parser.add_argument("--max-tokens", type=int, help=f"output tokens ({MAX_TOKENS}; 64 and ignore_eos with --mesh)")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    spec = SpeculativeConfig.from_json(args.config)
    levels = [int(c) for c in args.concurrency.split(",")]
    found = cases(Tokenizer.from_path(default_model_path()), args.chat_prompts, levels)
    if args.mesh:
        mesh = SpeculativeMesh(args.config)
        max_tokens = args.max_tokens or 64
        try:
            mesh.run("ngram", found[0][1][:1], 1, max_tokens)  # warm-up
            mesh.run("default", found[0][1][:1], 1, max_tokens)
            runs = _alternate(found, args.repeats, lambda system, prompts, c: mesh.run(system, prompts, c, max_tokens))
        finally:
            mesh.stop()
        formats = "decode workers' defaults"
    else:
        limit_malloc_arenas()
        torch.set_num_threads(args.threads)
        files = load_model_files(None, torch.float32)
        cache = CacheConfig(enable_prefix_caching=False)
        engines = {"default": Engine(EngineConfig(cache=cache), files=files),
                   "ngram": build_engine(EngineConfig(cache=cache, speculative=spec), files=files)}
        for engine in engines.values():  # warm-up
            closed_loop(engine, found[0][1][:1], 1)
        max_tokens = args.max_tokens or MAX_TOKENS
        runs = _alternate(found, args.repeats,
                          lambda system, prompts, c: closed_loop(engines[system], prompts, c, max_tokens))
        formats = engines["default"].formats.describe()
    machine = describe()
    print(f"\n{machine['processor']} ({', '.join(machine['isa'])}), {args.threads} thread(s); {formats}; "
          f"{'through the mesh; ' if args.mesh else ''}speculative config {spec}\n")
    print("| case | default tok/s | ngram tok/s | ratio | acceptance |")
    print("|---|---:|---:|---:|---:|")
    for name, _, concurrency in found:
        key = "decode_tok_s" if concurrency == 1 else "output_tok_s"
        base = statistics.median(r[key] for r in runs[name]["default"])
        ours = statistics.median(r[key] for r in runs[name]["ngram"])
        drafted = sum(r["draft_tokens"] for r in runs[name]["ngram"])
        accepted = sum(r["accepted_tokens"] for r in runs[name]["ngram"])
        rate = f"{accepted / drafted:.0%} of {drafted:.0f}" if drafted else "no drafts"
        print(f"| {name} ({key.split('_')[0]}) | {base:.1f} | {ours:.1f} | {ours / base:.2f}x | {rate} |")
    write_results(args.out, {"command": command_line(__name__, argv), "machine": machine, "load": load_average(),
                             "threads": args.threads, "formats": formats, "mesh": args.mesh,
                             "max_tokens": max_tokens, "speculative": vars(spec), "runs": runs})
    return 0


def _alternate(found: list[tuple[str, list[list[int]], int]], repeats: int,
               run: Callable[[str, list[list[int]], int], dict]) -> dict[str, dict[str, list[dict]]]:
    """Each case `repeats` times on each system, the systems alternated."""
    runs: dict[str, dict[str, list[dict]]] = {name: {"default": [], "ngram": []} for name, _, _ in found}
    for name, prompts, concurrency in found:
        for repeat in range(repeats):
            for system in ("default", "ngram"):
                result = run(system, prompts, concurrency)
                runs[name][system].append(result)
                print(f"[speculative] {name} run {repeat + 1} {system}: output {result['output_tok_s']:.1f} tok/s, "
                      f"decode {result['decode_tok_s']:.1f} tok/s, accepted {result['accepted_tokens']:.0f}/"
                      f"{result['draft_tokens']:.0f}", flush=True)
    return runs
