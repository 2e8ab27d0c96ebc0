"""Exact against approximate prefix routing on multi-turn chat behind two gateway replicas: the
workers' prefix-hit rate and the TTFT of later turns, the modes alternating in short phases.

What separates the indexes in a deployment: gateways run as replicas behind a load balancer, and a
conversation's turns reach different ones. Each approximate index (`--prefix-index approximate`)
knows only where its own gateway sent a prefix; the exact one (the workers' block events, which
every gateway watches) knows where every block is, whoever placed it. So two gateways route over the
same two colocated workers (`--threads 1`, one core each with taskset), and a conversation's
consecutive turns alternate between them (bench.common.chat_replay.gateway_of). Each worker's KV
cache holds --pool-fraction / 2 of the working set (every conversation's last prompt, estimated
before the run): the pool holds every conversation, so routing a turn to the worker that holds its
history keeps it cached, and routing it elsewhere computes it again and evicts.

The conversations are ShareGPT V3's as bench.common.conversations replays them: turns round-robin
over the conversations with --concurrency requests in flight, replies the model's own (greedy,
--max-tokens each, ignore_eos), made in a warm-up (the first turns, uncounted) and the first
phase and replayed after, so every phase sends the same prompts. The objectives are out of reach
of any miss: admission never queues or refuses, and routing alone differs.

Fairness on a shared, loaded machine: the modes alternate in --phases short phases (exact,
approximate, exact, ...) on the same two workers, each phase with fresh gateways and its own
`cache_salt`, so nothing an earlier phase cached is a hit (its blocks are evictable, counted free).
Each figure is the median over a mode's phases; the first turns' TTFT, which no index can help, is
the control for the machine's load.

Hit rate: the workers' `vllm:prefix_cache_hits` over `vllm:prefix_cache_queries` during the phase,
both workers summed (a prompt computed by one worker and decoded by the other is a query on each);
cached share: the later turns' cached prompt tokens (their usage: the prefill site's hits) over
their prompt tokens.

    python -m bench prefix_routing [--conversations 8] [--turns 4] [--concurrency 4] [--pool-fraction 1.3]
                                   [--phases 4] [--max-tokens 24] [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence

from bench.common.chat_replay import Replay
from bench.common.conversations import chat_workload, worker_counters
from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results

BLOCK_SIZE = 16
MODES = ("exact", "approximate")
WORKERS = 2
GATEWAYS = 2
NO_MISS_MS = "600000"  # objectives every request meets: admission neither waits nor refuses
RATIOS = ("hit_rate", "cached_share", "ttft_p50_s", "ttft_p90_s", "first_ttft_p50_s")


def parse_args(argv: Sequence[str]):
    """Flags; --quick is a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="turns (human messages) per conversation")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--pool-fraction", type=float, default=1.3,
                        help="both workers' KV caches together as a fraction of the working set")
    parser.add_argument("--phases", type=int, default=4, help="phases, the modes alternating (exact first)")
    parser.add_argument("--max-tokens", type=int, default=24, help="the model's reply to each turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 conversations of 3 turns, 2 phases (a smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.phases = 4, 3, 2
    if args.phases < 2:
        parser.error(f"--phases: at least 2 (one per mode), got {args.phases}")
    args.out = args.out or results_path(__name__, smoke=args.quick)
    return args


def phase_modes(phases: int) -> list[str]:
    """The mode of each phase: alternating, exact first."""
    return [MODES[phase % len(MODES)] for phase in range(phases)]


def run_phase(mode: str, replay: Replay, workers: list, tokenizer) -> dict:
    """One replay through GATEWAYS fresh gateways of `mode` over `workers`: its requests, and the
    workers' prefix-cache counters and the gateways' placements it added."""
    from harness.worker import start_worker

    before = [worker_counters(str(worker.metrics_address), ("vllm:prefix_cache",)) for worker in workers]
    gateways = []
    try:
        for _ in range(GATEWAYS):
            gateways.append(start_worker(
                ["gateway", "--port", "0", "--http-port", "0", "--prefix-index", mode, "--ttft-slo-ms", NO_MISS_MS,
                 "--tpot-slo-ms", NO_MISS_MS, "--colocated", ",".join(str(worker.address) for worker in workers)]))
        requests = replay.run([str(gateway.address) for gateway in gateways], tokenizer)
        placed = [worker_counters(str(gateway.http_address), ("tandem:placements",), label="kind")
                  for gateway in gateways]
    finally:
        for gateway in gateways:
            gateway.stop()
    after = [worker_counters(str(worker.metrics_address), ("vllm:prefix_cache",)) for worker in workers]
    added = {name: sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))
             for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
    placements: dict[str, float] = {}
    for counters in placed:
        for name, value in counters.items():
            if name.startswith("tandem:placements_total{"):
                kind = name.split("{")[1].rstrip("}")
                placements[kind] = placements.get(kind, 0.0) + value
    return {"mode": mode, "requests": requests, "worker_counters": added, "placements": placements}


def summary(phase: dict) -> dict:
    """A phase's figures: the workers' hit rate, the later turns' cached share and TTFT p50/p90, the
    first turns' TTFT p50 (the load control)."""
    later = [request for request in phase["requests"] if request["turn"] > 1]
    first = [request["ttft_s"] for request in phase["requests"] if request["turn"] == 1]
    ttfts = sorted(request["ttft_s"] for request in later)
    queries = phase["worker_counters"]["vllm:prefix_cache_queries_total"]
    hits = phase["worker_counters"]["vllm:prefix_cache_hits_total"]
    return {"hit_rate": hits / queries if queries else 0.0, "queries": queries, "hits": hits,
            "cached_share": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
            "first_ttft_p50_s": statistics.median(first), "placements": phase["placements"]}


def medians(summaries: list[dict]) -> dict[str, float]:
    """Each figure's median over one mode's phases."""
    return {key: statistics.median(s[key] for s in summaries) for key in RATIOS}


def ratios(by_mode: dict[str, dict[str, float]]) -> dict[str, float]:
    """Exact over approximate, figure by figure (NaN where approximate's is 0)."""
    exact, approximate = by_mode["exact"], by_mode["approximate"]
    return {key: exact[key] / approximate[key] if approximate[key] else float("nan") for key in RATIOS}


def main(argv: Sequence[str]) -> int:
    """The phases; the table and the JSON results."""
    from harness.worker import start_worker

    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    workload = chat_workload(args.conversations, args.turns, args.seed, args.max_tokens)
    total, tokenizer = workload.working_set_tokens, workload.tokenizer
    blocks = workload.kv_blocks(int(total * args.pool_fraction / WORKERS), args.max_tokens, BLOCK_SIZE)
    replies: list[list[str | None]] = [[None] * args.turns for _ in workload.conversations]
    load = {"start": load_average()}
    cores = os.cpu_count() or 1
    workers = [start_worker(["worker", "--role", "colocated", "--port", "0", "--threads", "1",
                             "--kv-cache-blocks", str(blocks), "--block-size", str(BLOCK_SIZE)], wait=False,
                            wrapper=["taskset", "-c", str(index % cores)]) for index in range(WORKERS)]
    phases = []
    try:
        for worker in workers:
            worker.wait_ready()
        # Fresh workers' first steps are slow (allocations, kernels' first calls): the first turns once,
        # uncounted, before the first phase (their replies are the phases' too).
        warm_up = Replay(workload.conversations, replies, 1, args.max_tokens, args.concurrency, cache_salt="warm-up")
        run_phase(MODES[0], warm_up, workers, tokenizer)
        for number, mode in enumerate(phase_modes(args.phases)):
            print(f"[prefix_routing] phase {number + 1}: {mode} (load {load_average()})", file=sys.stderr, flush=True)
            replay = Replay(workload.conversations, replies, args.turns, args.max_tokens, args.concurrency,
                            cache_salt=f"phase-{number}")
            phases.append(run_phase(mode, replay, workers, tokenizer))
            load[f"after phase {number + 1}"] = load_average()
    finally:
        for worker in workers:
            worker.stop()
    summaries = [summary(phase) for phase in phases]
    by_mode = {mode: medians([s for s, p in zip(summaries, phases, strict=True) if p["mode"] == mode])
               for mode in MODES}
    exact_over_approximate = ratios(by_mode)
    machine = describe()
    print(f"working set {total} tokens; KV {blocks * BLOCK_SIZE} tokens per worker, the pool "
          f"{WORKERS * blocks * BLOCK_SIZE / total:.2f}x the working set; {len(workload.conversations)} conversations "
          f"x {args.turns} turns, {args.concurrency} in flight, {GATEWAYS} gateways, {args.phases} phases")
    print("| phase | index | prefix-hit rate (workers) | cached share, later turns | TTFT p50 later turns (ms) "
          "| TTFT p90 later turns (ms) | TTFT p50 first turns (ms) | placements |")
    print("|---|---|---|---|---|---|---|---|")
    for number, (phase, s) in enumerate(zip(phases, summaries, strict=True)):
        placed = ", ".join(f"{kind} {value:g}" for kind, value in sorted(s["placements"].items()))
        print(f"| {number + 1} | {phase['mode']} | {s['hit_rate']:.3f} | {s['cached_share']:.3f} "
              f"| {s['ttft_p50_s'] * 1000:.0f} | {s['ttft_p90_s'] * 1000:.0f} | {s['first_ttft_p50_s'] * 1000:.0f} "
              f"| {placed} |")
    for mode in MODES:
        m = by_mode[mode]
        print(f"| median | {mode} | {m['hit_rate']:.3f} | {m['cached_share']:.3f} | {m['ttft_p50_s'] * 1000:.0f} "
              f"| {m['ttft_p90_s'] * 1000:.0f} | {m['first_ttft_p50_s'] * 1000:.0f} | |")
    r = exact_over_approximate
    print(f"| | exact / approximate | {r['hit_rate']:.2f}x | {r['cached_share']:.2f}x | {r['ttft_p50_s']:.2f}x "
          f"| {r['ttft_p90_s']:.2f}x | {r['first_ttft_p50_s']:.2f}x | |")
    print(f"- {machine['processor']} ({', '.join(machine['isa'])}); load average: "
          + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "load_average": load, "working_set_tokens": total, "kv_blocks_per_worker": blocks,
                             "phases": phases, "summaries": summaries, "medians": by_mode,
                             "ratios": exact_over_approximate})
    return 0
