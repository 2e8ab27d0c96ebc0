"""Multi-turn chat over a working set several times one worker's KV budget: the TTFT of later turns
with the lower KV tiers (the node's host tier and a disk tier; the disk tier alone) against without,
in one run.

Conversations are ShareGPT V3's as bench.common.conversations replays them, the model's own greedy
replies (--max-tokens each, ignore_eos) the assistant's. Turns go round-robin over the conversations
(every first turn, then every second turn, ...), one request at a time (closed loop: TTFT without
queueing). The worker's KV cache holds --budget-fraction of the working set (every conversation's
last prompt, estimated from the human turns and --max-tokens replies before the run), so a
conversation's blocks are evicted from the device cache before its next turn: without tiers that
turn recomputes its whole prompt, with them it loads its prefix back. For the tiers it also prints how
long the loads took on the mover's thread and how much of that the forwards waited for (before
layer 0, and in all): what the overlap of the load with the prompt's compute did not hide. Each
system is a colocated worker process (its own host tier owner for "tiers"), run one after the other
on the same cores.

    python -m bench kv_tiers [--conversations 24] [--turns 4] [--budget-fraction 0.25] [--threads 2] [--quick]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common.conversations import chat_workload, worker_counters
from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results

BLOCK_SIZE = 16
# none: no lower tier; tiers: the node's host tier and a disk tier (loads come from memory first);
# disk: the disk tier alone (a node without a host tier).
SYSTEMS = ("none", "tiers", "disk")


def parse_args(argv: Sequence[str]):
    """Flags; --quick is a smoke run."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4, help="turns (human messages) per conversation")
    parser.add_argument("--budget-fraction", type=float, default=0.25,
                        help="the worker's KV cache as a fraction of the working set")
    parser.add_argument("--max-tokens", type=int, default=48, help="the model's reply to each turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 conversations of 2 turns (a smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 4, 2
    args.out = args.out or results_path(__name__, smoke=args.quick)
    return args


def run_system(system: str, conversations: list[list[str]], blocks: int, args, tokenizer) -> dict:
    """TTFT of every request, by turn, on one system; and its tier counters."""
    import grpc
    from tandem.v1 import decode_pb2, decode_pb2_grpc

    from engine.sampling_params import SamplingParams
    from harness.worker import start_worker
    from services.common.convert import sampling_params_to_proto
    from services.common.server import channel_options

    params = sampling_params_to_proto(SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    with tempfile.TemporaryDirectory() as scratch:
        owner = None
        flags = ["worker", "--role", "colocated", "--port", "0", "--threads", str(args.threads),
                 "--kv-cache-blocks", str(blocks), "--block-size", str(BLOCK_SIZE)]
        if system == "tiers":
            socket_path = str(Path(scratch) / "host.sock")
            owner = subprocess.Popen([sys.executable, "-m", "services.cli", "kv-host-tier", "--socket", socket_path,
                                      "--capacity-mib", "4096"])
            flags += ["--kv-host-tier", socket_path]
        if system != "none":
            flags += ["--kv-disk-tier", str(Path(scratch) / "disk")]
        worker = start_worker(flags)
        ttft: dict[int, list[float]] = {}
        history: list[list[dict]] = [[] for _ in conversations]
        try:
            with grpc.insecure_channel(worker.address, options=channel_options()) as channel:
                stub = decode_pb2_grpc.DecodeStub(channel)
                for turn in range(args.turns):
                    for index, turns in enumerate(conversations):
                        history[index].append({"role": "user", "content": turns[turn]})
                        prompt = tokenizer.encode_chat(history[index])
                        request = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling=params)
                        started = time.perf_counter()
                        stream = stub.Generate(request, timeout=600)
                        reply = []
                        for chunk in stream:
                            if not reply:
                                ttft.setdefault(turn + 1, []).append(time.perf_counter() - started)
                            reply += chunk.token_ids
                        history[index].append({"role": "assistant", "content": tokenizer.decode(reply)})
            counters = worker_counters(worker.metrics_address,
                                       ("tandem:kv_tier", "vllm:external_prefix_cache", "vllm:prefix_cache"))
        finally:
            worker.stop()
            if owner is not None:
                owner.kill()
                owner.wait()
    return {"ttft_s": ttft, "counters": counters}


def main(argv: Sequence[str]) -> int:
    """Both systems; the table and the JSON results."""
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    workload = chat_workload(args.conversations, args.turns, args.seed, args.max_tokens)
    conversations, total, tokenizer = workload.conversations, workload.working_set_tokens, workload.tokenizer
    blocks = workload.kv_blocks(int(total * args.budget_fraction), args.max_tokens, BLOCK_SIZE)
    load = {"start": load_average()}
    runs = {}
    for system in SYSTEMS:
        print(f"[kv_tiers] {system} (load {load_average()})", file=sys.stderr, flush=True)
        runs[system] = run_system(system, conversations, blocks, args, tokenizer)
        load[f"after {system}"] = load_average()
    later = {system: [t for turn, values in run["ttft_s"].items() if turn > 1 for t in values]
             for system, run in runs.items()}
    p50 = {system: statistics.median(values) for system, values in later.items()}
    ratios = {system: p50[system] / p50["none"] for system in SYSTEMS[1:]}
    machine = describe()
    print(f"working set {total} tokens, KV budget {blocks * BLOCK_SIZE} tokens "
          f"({blocks * BLOCK_SIZE / total:.2f}x), {len(conversations)} conversations x {args.turns} turns")
    print("| turn | " + " | ".join(f"TTFT p50 {s} (ms)" for s in SYSTEMS) + " |")
    print("|---|" + "---|" * len(SYSTEMS))
    for turn in range(1, args.turns + 1):
        row = [f"{statistics.median(runs[s]['ttft_s'][turn]) * 1000:.0f}" for s in SYSTEMS]
        print(f"| {turn} | " + " | ".join(row) + " |")
    for system, ratio in ratios.items():
        print(f"later turns: TTFT p50 {p50[system] * 1000:.0f} ms with {system}, {p50['none'] * 1000:.0f} ms without: "
              f"{ratio:.2f}x (target <= 0.5x: {'met' if ratio <= 0.5 else 'missed'})")
    for system in SYSTEMS[1:]:
        counters = runs[system]["counters"]
        print(f"{system} counters: " + ", ".join(f"{name} {value:g}" for name, value in counters.items()
                                                 if value and not name.endswith("_created")))
        loading = sum(v for name, v in counters.items() if name.startswith("tandem:kv_tier_load_seconds_total"))
        waited = counters.get("tandem:kv_tier_load_wait_seconds_total", 0.0)
        first = counters.get("tandem:kv_tier_first_layer_wait_seconds_total", 0.0)
        print(f"{system}: loads took {loading * 1000:.1f} ms on the mover's thread; the forwards waited "
              f"{waited * 1000:.1f} ms for them, {first * 1000:.1f} ms of it before layer 0")
    print(f"- {machine['processor']} ({', '.join(machine['isa'])}); load average: "
          + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "load_average": load, "working_set_tokens": total, "kv_blocks": blocks,
                             "runs": runs, "later_turns_ttft_p50_s": p50, "ratios": ratios})
    return 0
