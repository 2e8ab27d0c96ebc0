"""TTFT and the KV transfer across separate hosts on capped links, against loopback and in-process.

Phases, one after another (never competing for the CPUs), all with float32 KV (`--dtype float32`
workers; the in-process engine's KV dtype is printed and must match):

1. In-process: the engine in a child process, the prompts one by one (mesh_overhead's baseline).
2. Loopback: a gateway, a prefill and a decode worker on 127.0.0.1 (torch_dist KV).
3. Hosts (bench.harness.hosts, needs root): a gateway host, a prefill host and a decode host, each a
   network namespace on one bridge; per link (uncapped, then each of --rates) the prefill host's
   outgoing traffic is capped by a token bucket (tc tbf) and the same requests run.

Per link, TTFT is measured at the client (first chunk with a token) and the prefill worker reports
its delivery wait (first token, i.e. just after the last layer was computed, to every page held by
the receiver). The transfer alone on the same link is the kv_rig's 512-token prompt sent by a
KVSenderPool on the prefill side (on the prefill host: its capped link) to a receiver here (on the
client host for the namespaces), scaled linearly to --prompt-tokens. Hidden share of the transfer =
1 - delivery wait / transfer alone (the issue's definition), clamped to [0, 1].

Latency cannot be injected (the kernel has no `netem`): every link here has sub-millisecond round
trips and only its bandwidth differs.

    python -m bench links [--requests 3] [--prompt-tokens 256] [--output-tokens 8]
                          [--rates 1gbit,200mbit] [--transfer-runs 3] [--quick]

Writes bench/results/links.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence

from bench.harness import kv_rig
from bench.harness.host_mesh import start_host_mesh
from bench.harness.hosts import Hosts, namespaces_unavailable
from bench.harness.mesh import start_mesh
from bench.harness.remote_sender import RemoteSender
from bench.harness.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.suites.mesh_overhead import RequestTiming, make_prompts, mesh_request, run_inprocess, run_transfer

WORKER_FLAGS = ["--threads", "1", "--dtype", "float32"]
KV_DTYPE = "float32"
HIDDEN_TARGET = 0.80


def _time_requests(gateway_address: str, prompts: list[list[int]], output_tokens: int,
                   ca_file: str | None = None) -> list[RequestTiming]:
    """Every prompt through the gateway; the first one (a warm-up) is dropped."""
    from services.client import TandemClient

    with TandemClient(gateway_address, ca_file=ca_file) as client:
        return [mesh_request(client, prompt, output_tokens) for prompt in prompts][1:]


def _link_figures(timed: list[RequestTiming], transfer_s: float) -> dict:
    waits = [t.delivery_wait_s for t in timed if t.delivery_wait_s is not None]
    wait = statistics.median(waits) if waits else None
    return {
        "ttft_s": statistics.median(t.ttft_s for t in timed),
        "delivery_wait_s": wait,
        "transfer_alone_s": transfer_s,
        "hidden": None if wait is None else min(1.0, max(0.0, 1.0 - wait / transfer_s)),
    }


def _scaled(seconds: float, prompt_tokens: int) -> float:
    return seconds * prompt_tokens / kv_rig.PROMPT_TOKENS


def run_loopback(prompts: list[list[int]], output_tokens: int, transfer_runs: int, prompt_tokens: int) -> dict:
    """Phase 2."""
    mesh = start_mesh(worker_flags=WORKER_FLAGS, gateway_flags=["--ttft-slo-ms", "600000"])
    try:
        timed = _time_requests(str(mesh.gateway.address), prompts, output_tokens)
    finally:
        mesh.stop()
    return _link_figures(timed, _scaled(run_transfer("torch_dist", transfer_runs), prompt_tokens))


def _transfer_alone(hosts: Hosts, runs: int) -> float:
    """Median seconds of the rig's prompt from the prefill host to a receiver on the client host."""
    from kvtransfer.receiver import make_receiver

    sender = RemoteSender(hosts.exec_argv("prefill-1"))
    receiver = make_receiver("torch_dist", hosts.client_address, "", timeout=120.0)
    try:
        run = kv_rig.BackendRun(sender, receiver)  # type: ignore[arg-type]
        return statistics.median(run.once() for _ in range(runs))
    finally:
        sender.close()
        receiver.close()


def run_hosts(prompts: list[list[int]], output_tokens: int, rates: list[str], transfer_runs: int,
              prompt_tokens: int) -> dict[str, dict]:
    """Phase 3: one mesh across three hosts, each link condition in turn."""
    hosts = Hosts(["gateway", "prefill-1", "decode-1"])
    try:
        mesh = start_host_mesh(hosts, WORKER_FLAGS, decode_flags={"decode-1": ["--kv-backend", "torch_dist"]},
                               gateways={"gateway": ["decode-1"]}, gateway_flags=["--ttft-slo-ms", "600000"],
                               prefill_hosts=["prefill-1"])
        figures = {}
        try:
            for rate in ["uncapped", *rates]:
                if rate == "uncapped":
                    hosts.uncap("prefill-1")
                else:
                    hosts.cap("prefill-1", rate)
                print(f"  link {rate} ...", flush=True)
                timed = _time_requests(str(mesh.gateways["gateway"].address), prompts, output_tokens)
                alone = _scaled(_transfer_alone(hosts, transfer_runs), prompt_tokens)
                figures[rate] = _link_figures(timed, alone)
        finally:
            mesh.stop()
        return figures
    finally:
        hosts.close()


def print_table(args: argparse.Namespace, in_process_ttft: float, links: dict[str, dict], loads: dict) -> None:
    print(f"\n{args.requests} requests one after another, {args.prompt_tokens}-token prompts, {args.output_tokens} "
          f"output tokens, greedy, torch_dist (gloo) KV in {KV_DTYPE}; medians. No latency injected "
          f"(no netem): bandwidth caps only.")
    print(f"load average: {loads['start']} (start), {loads['end']} (end)\n")
    print("| link | TTFT (ms) | vs in-process | delivery wait (ms) | transfer alone (ms) | hidden |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| in-process | {in_process_ttft * 1e3:.1f} | 1.00x | | | |")
    for name, row in links.items():
        wait = "" if row["delivery_wait_s"] is None else f"{row['delivery_wait_s'] * 1e3:.1f}"
        hidden = "" if row["hidden"] is None else f"{row['hidden']:.0%}"
        print(f"| {name} | {row['ttft_s'] * 1e3:.1f} | {row['ttft_s'] / in_process_ttft:.2f}x | {wait} "
              f"| {row['transfer_alone_s'] * 1e3:.1f} | {hidden} |")
    print(f"\nhidden = 1 - delivery wait / transfer alone on the same link (target >= {HIDDEN_TARGET:.0%} at 1gbit)")


def main(argv: Sequence[str]) -> int:
    """The three phases in turn, the table, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--requests", type=int, default=3, help="timed requests per link (after one warm-up)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rates", default="1gbit,200mbit", help="tc rates the prefill host's link is capped at")
    parser.add_argument("--transfer-runs", type=int, default=3, help="timed transfers alone per link")
    parser.add_argument("--quick", action="store_true", help="1 request, 32-token prompts, 2 output tokens, "
                                                             "1 transfer, 200mbit only")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_tokens, args.output_tokens, args.transfer_runs = 1, 32, 2, 1
        args.rates = "200mbit"
    if args.output_tokens < 2:
        parser.error("--output-tokens must be at least 2 (TPOT needs two tokens)")
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"links: cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = "1"
    rates = [rate for rate in args.rates.split(",") if rate]
    prompts = make_prompts(args.requests + 1, args.prompt_tokens)
    loads = {"start": load_average()}
    print("phase 1/3: in-process engine ...", flush=True)
    local, shape = run_inprocess(prompts, args.output_tokens)
    if shape["dtype"] != KV_DTYPE:
        print(f"warning: the in-process engine's KV is {shape['dtype']}, the workers' {KV_DTYPE}", file=sys.stderr)
    in_process_ttft = statistics.median(t.ttft_s for t in local)
    print("phase 2/3: loopback mesh ...", flush=True)
    links = {"loopback": run_loopback(prompts, args.output_tokens, args.transfer_runs, args.prompt_tokens)}
    print("phase 3/3: hosts ...", flush=True)
    links.update(run_hosts(prompts, args.output_tokens, rates, args.transfer_runs, args.prompt_tokens))
    loads["end"] = load_average()
    print_table(args, in_process_ttft, links, loads)
    write_results(results_path(__name__, args.quick), {
        "command": command_line(__name__, argv), "settings": vars(args), "load_average": loads,
        "kv_dtype": KV_DTYPE, "engine_kv_shape": shape, "in_process_ttft_s": in_process_ttft, "links": links,
        "note": "no latency injected: the kernel has no netem; links differ in bandwidth only",
    })
    return 0
