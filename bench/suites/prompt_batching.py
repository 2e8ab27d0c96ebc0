"""Does batching a second prompt into a busy step cost the first prompt's time to first token?

A prefill worker (or a colocated one) with prompts waiting puts as many as its token budget holds
into one step, and every prompt in that step gets its first token only when the whole step ends.
On a device that one prompt already saturates (a CPU core), the batch computes no faster than the
prompts would one after another, so the first prompt waits for the others for nothing.
`SchedulerConfig.max_prompt_batch_tokens` stops a step from starting another prompt beyond a
number of prompt tokens.

This replays open-loop Poisson arrivals of the goodput benchmark's ShareGPT prompts (max_tokens 1,
so each request is one prompt's prefill, as at a prefill worker) on one engine (one thread, no
prefix cache) with and without the limit, alternately, and prints TTFT p50/p90/mean and the
makespan of each, side by side.

    python -m bench prompt_batching [--rate 1.4] [--requests 60] [--limit 256] [--repeats 2]
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

import torch

from bench.common.suite import command_line, results_path, suite_parser, write_results
from bench.common.workload import build_workload
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.model.loader import load_model_files
from engine.sampling_params import SamplingParams
from services.common.malloc_arenas import limit_malloc_arenas


def replay(engine: Engine, prompts: list[list[int]], arrivals: list[float]) -> dict:
    """Each prompt added at its arrival time (seconds from the start); TTFT per prompt."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, float] = {}
    added = 0
    while len(first) < len(prompts):
        now = time.perf_counter() - start
        while added < len(prompts) and arrivals[added] <= now:
            engine.add_request(f"p{added}", prompts[added], params)
            added += 1
        if engine.has_unfinished():
            for output in engine.step():
                first.setdefault(output.request_id, time.perf_counter() - start)
        elif added < len(prompts):
            time.sleep(max(0.0, arrivals[added] - (time.perf_counter() - start)))
    ttft = sorted(first[f"p{i}"] - arrivals[i] for i in range(len(prompts)))
    return {"ttft_p50_s": ttft[len(ttft) // 2], "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
            "ttft_mean_s": statistics.fmean(ttft), "ttft_over_2s": sum(t > 2.0 for t in ttft),
            "makespan_s": max(first.values())}


def main(argv: Sequence[str]) -> int:
    """Both schedulers on the same arrivals, alternately; the table and the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--rate", type=float, default=1.4, help="prompts per second (Poisson)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--limit", type=int, default=256, help="max_prompt_batch_tokens to compare with none")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    limit_malloc_arenas()  # as the workers do
    torch.set_num_threads(1)
    files = load_model_files(None, torch.float32)
    engines = {
        name: Engine(EngineConfig(cache=CacheConfig(enable_prefix_caching=False),
                                  scheduler=SchedulerConfig(max_prompt_batch_tokens=limit)), files=files)
        for name, limit in (("no limit", None), (f"limit {args.limit}", args.limit))
    }
    tokenizer = next(iter(engines.values())).tokenizer
    workload = build_workload(args.requests, args.seed, lambda text: tokenizer.encode(text, add_special_tokens=False),
                              tokenizer.decode)
    prompts = [tokenizer.encode(request.prompt) for request in workload.requests]
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    for engine in engines.values():  # warm-up
        replay(engine, prompts[:2], [0.0, 0.0])
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            result = replay(engine, prompts, arrivals)
            runs[name].append(result)
            figures = ", ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                                for key, value in result.items())
            print(f"[prompt_batching] run {repeat + 1}, {name}: {figures}", flush=True)
    print(f"\n{workload.source}; {len(prompts)} prompts at {args.rate} req/s, one thread\n")
    print("| scheduler | TTFT p50 (s) | TTFT p90 (s) | TTFT mean (s) | TTFT > 2 s | makespan (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, results in runs.items():
        cells = [statistics.median(r[key] for r in results) for key in
                 ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "ttft_over_2s", "makespan_s")]
        print(f"| {name} | {cells[0]:.2f} | {cells[1]:.2f} | {cells[2]:.2f} | {cells[3]:g} | {cells[4]:.1f} |")
    write_results(args.out, {"command": command_line(__name__, argv), "rate": args.rate,
                             "workload": workload.source, "runs": runs})
    return 0

