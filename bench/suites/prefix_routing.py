"""Exact against approximate prefix routing on multi-turn chat: the workers' prefix-hit rate and the
TTFT of later turns, one gateway over two colocated workers, both indexes in one run.

The conversations are ShareGPT V3's as bench.common.conversations replays them. Turns go round-robin
over the conversations (every first turn, then every second turn, ...) with --concurrency requests
in flight (a conversation's next turn waits for its previous reply), so the router weighs each
worker's load against where the prefix is. Each worker (one core, --threads 1) holds --pool-fraction
/ 2 of the working set (every conversation's last prompt, estimated before the run) in its KV cache:
a conversation's blocks may be gone before its next turn, which the exact index (the workers' block
events) sees and the approximate one (the gateway's placements, bounded by each worker's KV size)
can only guess. The modes run one after the other on fresh processes, exact first; its replies (the
model's own, greedy, --max-tokens each, ignore_eos) are replayed in the approximate run, so both
send the same prompts. The objectives are set out of reach of any miss, so admission never queues or
refuses and routing alone differs.

Hit rate: the workers' `vllm:prefix_cache_hits` over `vllm:prefix_cache_queries`, both workers summed
(a prompt computed by one worker and decoded by the other is a query on each); "cached share": the
later turns' cached prompt tokens (their usage, the prefill site's hits) over their prompt tokens.

    python -m bench prefix_routing [--conversations 16] [--turns 4] [--concurrency 4] [--pool-fraction 0.5]
                                   [--max-tokens 32] [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from bench.common.conversations import chat_workload, worker_counters
from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results

BLOCK_SIZE = 16
MODES = ("exact", "approximate")
WORKERS = 2
NO_MISS_MS = "600000"  # objectives every request meets: admission neither waits nor refuses


def parse_args(argv: Sequence[str]):
    """Flags; --quick is a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4, help="turns (human messages) per conversation")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--pool-fraction", type=float, default=0.5,
                        help="both workers' KV caches together as a fraction of the working set")
    parser.add_argument("--max-tokens", type=int, default=32, help="the model's reply to each turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="6 conversations of 2 turns (a smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 6, 2
    args.out = args.out or results_path(__name__, smoke=args.quick)
    return args


def run_mode(mode: str, conversations: list[list[str]], replies: list[list[str | None]], blocks: int, args,
             tokenizer) -> dict:
    """Every turn through a gateway routing by the `mode` index: TTFT, prompt and cached tokens by
    turn; the workers' and gateway's counters. Fills `replies` where it has None (the model's)."""
    from harness.worker import start_worker
    from services.client import TandemClient

    cores = os.cpu_count() or 1
    workers = [start_worker(["worker", "--role", "colocated", "--port", "0", "--threads", "1",
                             "--kv-cache-blocks", str(blocks), "--block-size", str(BLOCK_SIZE)], wait=False,
                            wrapper=["taskset", "-c", str(index % cores)]) for index in range(WORKERS)]
    gateway = None
    try:
        for worker in workers:
            worker.wait_ready()
        gateway = start_worker(["gateway", "--port", "0", "--http-port", "0", "--prefix-index", mode,
                                "--ttft-slo-ms", NO_MISS_MS, "--tpot-slo-ms", NO_MISS_MS,
                                "--colocated", ",".join(str(worker.address) for worker in workers)])
        answered = [[threading.Event() for _ in turns] for turns in conversations]
        requests: list[dict] = []
        with TandemClient(str(gateway.address)) as client:

            def turn(job: tuple[int, int]) -> None:
                try:
                    ask(*job)
                finally:  # a failed turn fails the run (pool.map raises it), not its next turn's wait
                    answered[job[0]][job[1]].set()

            def ask(index: int, number: int) -> None:
                if number:
                    answered[index][number - 1].wait()
                history: list[dict] = []
                for earlier in range(number):
                    history += [{"role": "user", "content": conversations[index][earlier]},
                                {"role": "assistant", "content": replies[index][earlier]}]
                prompt = tokenizer.encode_chat([*history, {"role": "user", "content": conversations[index][number]}])
                started = time.perf_counter()
                ttft, reply, usage = None, [], None
                for chunk in client.generate(token_ids=prompt, max_tokens=args.max_tokens, temperature=0.0,
                                             ignore_eos=True, timeout=600):
                    if ttft is None and chunk.token_ids:
                        ttft = time.perf_counter() - started
                    reply += chunk.token_ids
                    usage = chunk.usage or usage
                if replies[index][number] is None:
                    replies[index][number] = tokenizer.decode(reply)
                requests.append({"turn": number + 1, "ttft_s": ttft, "prompt_tokens": len(prompt),
                                 "cached_tokens": usage.cached_tokens if usage is not None else 0})

            jobs = [(index, number) for number in range(args.turns) for index in range(len(conversations))]
            # Submitted in turn order: a worker thread waits on a previous turn only behind the turns
            # submitted before it, so the pool never deadlocks.
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(turn, jobs))
        counters = [worker_counters(str(worker.metrics_address), ("vllm:prefix_cache",)) for worker in workers]
        placed = worker_counters(str(gateway.http_address), ("tandem:placements",), label="kind")
    finally:
        for process in ([gateway] if gateway is not None else []) + workers:
            process.stop()
    return {"requests": requests, "worker_counters": counters, "placements": placed}


def _summary(run: dict) -> dict:
    later = [request for request in run["requests"] if request["turn"] > 1]
    ttfts = sorted(request["ttft_s"] for request in later)
    queries = sum(c.get("vllm:prefix_cache_queries_total", 0.0) for c in run["worker_counters"])
    hits = sum(c.get("vllm:prefix_cache_hits_total", 0.0) for c in run["worker_counters"])
    placements = {name.split("{")[1].rstrip("}"): value for name, value in run["placements"].items()
                  if name.startswith("tandem:placements_total{")}
    return {"hit_rate": hits / queries if queries else 0.0, "queries": queries, "hits": hits,
            "cached_share": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
            "later_requests": len(later), "placements": placements}


def main(argv: Sequence[str]) -> int:
    """Both modes; the table and the JSON results."""
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    workload = chat_workload(args.conversations, args.turns, args.seed, args.max_tokens)
    conversations, total, tokenizer = workload.conversations, workload.working_set_tokens, workload.tokenizer
    blocks = workload.kv_blocks(int(total * args.pool_fraction / WORKERS), args.max_tokens, BLOCK_SIZE)
    replies: list[list[str | None]] = [[None] * args.turns for _ in conversations]
    load = {"start": load_average()}
    runs, summaries = {}, {}
    for mode in MODES:
        print(f"[prefix_routing] {mode} (load {load_average()})", file=sys.stderr, flush=True)
        runs[mode] = run_mode(mode, conversations, replies, blocks, args, tokenizer)
        summaries[mode] = _summary(runs[mode])
        load[f"after {mode}"] = load_average()
    exact, approximate = summaries["exact"], summaries["approximate"]
    ratios = {key: exact[key] / approximate[key] if approximate[key] else float("nan")
              for key in ("hit_rate", "cached_share", "ttft_p50_s", "ttft_p90_s")}
    machine = describe()
    print(f"working set {total} tokens; KV {blocks * BLOCK_SIZE} tokens per worker, the pool "
          f"{WORKERS * blocks * BLOCK_SIZE / total:.2f}x the working set; {len(conversations)} conversations x "
          f"{args.turns} turns, {args.concurrency} in flight")
    print("| index | prefix-hit rate (workers) | cached share, later turns | TTFT p50 later turns (ms) "
          "| TTFT p90 later turns (ms) | placements |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        s = summaries[mode]
        placed = ", ".join(f"{kind} {value:g}" for kind, value in sorted(s["placements"].items()))
        print(f"| {mode} | {s['hit_rate']:.3f} | {s['cached_share']:.3f} | {s['ttft_p50_s'] * 1000:.0f} "
              f"| {s['ttft_p90_s'] * 1000:.0f} | {placed} |")
    print(f"| exact / approximate | {ratios['hit_rate']:.2f}x | {ratios['cached_share']:.2f}x "
          f"| {ratios['ttft_p50_s']:.2f}x | {ratios['ttft_p90_s']:.2f}x | |")
    print(f"- {machine['processor']} ({', '.join(machine['isa'])}); load average: "
          + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "load_average": load, "working_set_tokens": total, "kv_blocks_per_worker": blocks,
                             "runs": runs, "summaries": summaries, "ratios": ratios})
    return 0
