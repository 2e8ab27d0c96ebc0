"""TTFT and the KV transfer across separate hosts on capped links, against loopback and in-process;
what the KV checksum costs on each link.

Phases, one after another (never competing for the CPUs), all with float32 KV (`--dtype float32`
workers; the in-process engine's KV dtype is printed and must match):

1. In-process: the engine in a child process, the prompts of each size one by one (mesh_overhead's
   baseline).
2. Loopback: a gateway, a prefill and a decode worker on 127.0.0.1 (torch_dist KV).
3. Hosts (harness.hosts, needs root): a gateway host, a prefill host and a decode host, each a
   network namespace on one bridge; per link (uncapped, then each of --rates) the prefill host's
   outgoing traffic is capped by a token bucket (tc tbf) and the same requests run.

Per link and prompt size, TTFT is measured at the client (first chunk with a token) and the prefill
worker reports its delivery wait (first token, i.e. just after the last layer was computed, to every
page held by the receiver). The transfer alone on the same link is the kv_rig's 512-token prompt
sent by a KVSenderPool on the prefill side (on the prefill host: its capped link) to a receiver here
(on the client host for the namespaces), scaled linearly to each prompt size. Hidden share of the
transfer = 1 - delivery wait / transfer alone (the issue's definition), clamped to [0, 1].

The transfer alone runs on both backends (torch_dist over gloo, grpc) with `--kv-checksum` on and
off at both ends: the checksum's share of a transfer is 1 - off / on, on the same link in the same
run (CRC32C for both backends here; CHECKSUM_LIMIT is the share above which it would not stay on
by default).

Latency cannot be injected (the kernel has no `netem`): every link here has sub-millisecond round
trips and only its bandwidth differs.

    python -m bench links [--requests 3] [--prompt-tokens 256,1024] [--output-tokens 8]
                          [--rates 1gbit,200mbit] [--transfer-runs 7] [--quick]

Writes bench/results/links.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence

from bench.common import kv_rig
from bench.common.remote_sender import RemoteSender
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.suites.mesh_overhead import RequestTiming, make_prompts, mesh_request, run_inprocess
from harness.host_mesh import start_host_mesh
from harness.hosts import Hosts, namespaces_unavailable
from harness.mesh import start_mesh

WORKER_FLAGS = ["--threads", "1", "--dtype", "float32"]
KV_DTYPE = "float32"
HIDDEN_TARGET = 0.80
CHECKSUM_LIMIT = 0.03
BACKENDS = ("torch_dist", "grpc")


def _time_requests(gateway_address: str, prompts: list[list[int]], output_tokens: int) -> list[RequestTiming]:
    """Every prompt through the gateway; the first one (a warm-up) is dropped."""
    from services.client import TandemClient

    with TandemClient(gateway_address) as client:
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


def _transfers(sender_wrapper: list[str], bind_host: str, runs: int) -> dict[str, dict[str, float]]:
    """Median seconds of the rig's prompt from a sender started behind `sender_wrapper` to receivers
    on `bind_host`, per backend and per `--kv-checksum` (the same at both ends); the on and off runs
    alternate, so that both see the same moments of a noisy machine."""
    from kvtransfer.receiver import make_receiver

    sender = RemoteSender(sender_wrapper)
    figures: dict[str, dict[str, float]] = {}
    stops = []
    try:
        for backend in BACKENDS:
            pairs = {}
            for checksum in (True, False):
                if backend == "torch_dist":
                    receiver = make_receiver(backend, bind_host, "", timeout=120.0, checksum=checksum)
                    stops.append(receiver.close)
                else:
                    receiver, stop = kv_rig.serve_grpc(checksum=checksum, host=bind_host)
                    stops += [receiver.close, stop]
                pairs[checksum] = kv_rig.BackendRun(sender, receiver, checksum=checksum)  # type: ignore[arg-type]
            seconds: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(runs):
                for checksum, run in pairs.items():
                    seconds[checksum].append(run.once())
            figures[backend] = {"on": statistics.median(seconds[True]), "off": statistics.median(seconds[False])}
    finally:
        for stop in stops:
            stop()
        sender.close()
    return figures


def _link(timed: dict[int, list[RequestTiming]], transfers: dict[str, dict[str, float]]) -> dict:
    """One link's figures: per prompt size against the torch_dist transfer alone (checksum on, the
    mesh's setting), and the transfers."""
    alone = transfers["torch_dist"]["on"]
    return {"requests": {size: _link_figures(rows, _scaled(alone, size)) for size, rows in timed.items()},
            "transfers": transfers}


def _prompt_sets(sizes: list[int], requests: int, link: int) -> dict[int, list[list[int]]]:
    """Each size's prompts (a warm-up and `requests`) for the `link`-th link, unlike every other
    link's: a prompt seen before would be answered from a worker's prefix cache, with no transfer."""
    return {size: make_prompts(requests + 1, size, seed=1000 * link + size) for size in sizes}


def run_loopback(prompt_sets: dict[int, list[list[int]]], output_tokens: int, transfer_runs: int) -> dict:
    """Phase 2."""
    mesh = start_mesh(worker_flags=WORKER_FLAGS, gateway_flags=["--ttft-slo-ms", "600000"])
    try:
        address = str(mesh.gateway.address)
        timed = {size: _time_requests(address, prompts, output_tokens) for size, prompts in prompt_sets.items()}
    finally:
        mesh.stop()
    return _link(timed, _transfers([], "127.0.0.1", transfer_runs))


def run_hosts(sizes: list[int], requests: int, output_tokens: int, rates: list[str],
              transfer_runs: int) -> dict[str, dict]:
    """Phase 3: one mesh across three hosts, each link condition in turn."""
    hosts = Hosts(["gateway", "prefill-1", "decode-1"])
    try:
        mesh = start_host_mesh(hosts, WORKER_FLAGS, decode_flags={"decode-1": ["--kv-backend", "torch_dist"]},
                               gateways={"gateway": ["decode-1"]}, gateway_flags=["--ttft-slo-ms", "600000"],
                               prefill_hosts=["prefill-1"])
        figures = {}
        try:
            address = str(mesh.gateways["gateway"].address)
            for link, rate in enumerate(["uncapped", *rates], start=1):
                if rate == "uncapped":
                    hosts.uncap("prefill-1")
                else:
                    hosts.cap("prefill-1", rate)
                print(f"  link {rate} ...", flush=True)
                timed = {size: _time_requests(address, prompts, output_tokens)
                         for size, prompts in _prompt_sets(sizes, requests, link).items()}
                transfers = _transfers(hosts.exec_argv("prefill-1"), hosts.client_address, transfer_runs)
                figures[rate] = _link(timed, transfers)
        finally:
            mesh.stop()
        return figures
    finally:
        hosts.close()


def checksum_share(on_s: float, off_s: float) -> float:
    """The checksum's share of a transfer with it on, from the same transfer with it off."""
    return max(0.0, 1.0 - off_s / on_s)


def print_table(args: argparse.Namespace, in_process: dict[int, float], links: dict[str, dict], loads: dict) -> None:
    print(f"\n{args.requests} requests one after another per prompt size, {args.output_tokens} output tokens, "
          f"greedy, torch_dist (gloo) KV in {KV_DTYPE} with CRC32C; medians. No latency injected (no netem): "
          "bandwidth caps only.")
    print(f"load average: {loads['start']} (start), {loads['end']} (end)\n")
    print("| link | prompt | TTFT (ms) | vs in-process | delivery wait (ms) | transfer alone (ms) | hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for size, ttft in in_process.items():
        print(f"| in-process | {size} | {ttft * 1e3:.1f} | 1.00x | | | |")
    for name, link in links.items():
        for size, row in link["requests"].items():
            wait = "" if row["delivery_wait_s"] is None else f"{row['delivery_wait_s'] * 1e3:.1f}"
            hidden = "" if row["hidden"] is None else f"{row['hidden']:.0%}"
            print(f"| {name} | {size} | {row['ttft_s'] * 1e3:.1f} | {row['ttft_s'] / in_process[size]:.2f}x | "
                  f"{wait} | {row['transfer_alone_s'] * 1e3:.1f} | {hidden} |")
    print(f"\nhidden = 1 - delivery wait / transfer alone on the same link (target >= {HIDDEN_TARGET:.0%} at 1gbit)")
    print(f"\nThe checksum on the same link, the rig's {kv_rig.PROMPT_TOKENS}-token prompt "
          f"({kv_rig.TOTAL_BYTES / 1e6:.1f} MB), --kv-checksum on and off at both ends:\n")
    print("| link | backend | on (ms) | off (ms) | checksum share |")
    print("|---|---|---:|---:|---:|")
    for name, link in links.items():
        for backend, row in link["transfers"].items():
            print(f"| {name} | {backend} | {row['on'] * 1e3:.1f} | {row['off'] * 1e3:.1f} | "
                  f"{checksum_share(row['on'], row['off']):.1%} |")
    print(f"\nchecksum share = 1 - off / on (stays on by default below {CHECKSUM_LIMIT:.0%})")


def main(argv: Sequence[str]) -> int:
    """The three phases in turn, the tables, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--requests", type=int, default=3, help="timed requests per link and size (after a warm-up)")
    parser.add_argument("--prompt-tokens", default="256,1024", help="prompt sizes, comma-separated")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rates", default="1gbit,200mbit", help="tc rates the prefill host's link is capped at")
    parser.add_argument("--transfer-runs", type=int, default=7, help="timed transfers alone per link and setting")
    parser.add_argument("--quick", action="store_true", help="1 request, 32-token prompts, 2 output tokens, "
                                                             "1 transfer, 200mbit only")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_tokens, args.output_tokens, args.transfer_runs = 1, "32", 2, 1
        args.rates = "200mbit"
    if args.output_tokens < 2:
        parser.error("--output-tokens must be at least 2 (TPOT needs two tokens)")
    sizes = [int(size) for size in args.prompt_tokens.split(",") if size]
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"links: cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = "1"
    rates = [rate for rate in args.rates.split(",") if rate]
    prompt_sets = _prompt_sets(sizes, args.requests, 0)
    loads = {"start": load_average()}
    print("phase 1/3: in-process engine ...", flush=True)
    in_process, shape = {}, {}
    for size, prompts in prompt_sets.items():
        local, shape = run_inprocess(prompts, args.output_tokens)
        in_process[size] = statistics.median(t.ttft_s for t in local)
    if shape["dtype"] != KV_DTYPE:
        print(f"warning: the in-process engine's KV is {shape['dtype']}, the workers' {KV_DTYPE}", file=sys.stderr)
    print("phase 2/3: loopback mesh ...", flush=True)
    links = {"loopback": run_loopback(prompt_sets, args.output_tokens, args.transfer_runs)}
    print("phase 3/3: hosts ...", flush=True)
    links.update(run_hosts(sizes, args.requests, args.output_tokens, rates, args.transfer_runs))
    loads["end"] = load_average()
    print_table(args, in_process, links, loads)
    write_results(results_path(__name__, args.quick), {
        "command": command_line(__name__, argv), "settings": vars(args), "load_average": loads,
        "kv_dtype": KV_DTYPE, "engine_kv_shape": shape, "in_process_ttft_s": in_process, "links": links,
        "note": "no latency injected: the kernel has no netem; links differ in bandwidth only",
    })
    return 0
