"""TTFT and the KV transfer across separate hosts on capped links, against loopback and in-process;
what the KV checksum costs on each link.

Phases, one after another (never competing for the CPUs), with float32 workers (`--dtype float32`;
the in-process engine's KV dtype is printed and must match) and float32 KV but for the settings of
phase 3's `--kv-formats`:

1. In-process: the engine in a child process, the prompts of each size one by one (mesh_overhead's
   baseline).
2. Loopback: a gateway, a prefill and a decode worker on 127.0.0.1 (torch_dist KV).
3. Hosts (harness.hosts, needs root): a gateway host, a prefill host and a decode host, each a
   network namespace on one bridge; per link (uncapped, then each of --rates) the prefill host's
   outgoing traffic is capped by a token bucket (tc tbf) and the same requests run. With
   `--kv-formats` (bench.common.kv_setting: e.g. float32,int8,int4,int4+w256,float32+b512), all of it
   once per KV setting, both workers restarted with its flags, the same prompts each time. Under a
   budget (+bB) the prefill worker scores each prompt and ships only the blocks the decode worker
   keeps, after the prompt's last layer (engine.kv_connector.export): fewer bytes, none overlapped.

Per link and prompt size, TTFT is measured at the client (first chunk with a token) and the prefill
worker reports its delivery wait (first token, i.e. just after the last layer was computed, to every
page held by the receiver). The bytes shipped are what the prefill worker's senders counted
(`tandem:kv_transfer_bytes`, read before and after a size's requests, warm-up included), per prompt
token. The transfer alone on the same link is the kv_rig's 512-token prompt in the setting's KV
format sent by a KVSenderPool on the prefill side (on the prefill host: its capped link) to a
receiver here (on the client host for the namespaces), scaled to the bytes each prompt shipped (so a
window's unsent head, or a budget's evicted blocks, counts as sent by neither). Hidden share of
the transfer = 1 - delivery wait / transfer alone (the issue's definition), clamped to [0, 1]. The
wire floor is the bytes shipped at the link's rate with no headers.

The transfer alone runs on both backends (torch_dist over gloo, grpc) with `--kv-checksum` on and
off at both ends: the checksum's share of a transfer is 1 - off / on, on the same link in the same
run (CRC32C for both backends here; CHECKSUM_LIMIT is the share above which it would not stay on
by default).

Latency cannot be injected (the kernel has no `netem`): every link here has sub-millisecond round
trips and only its bandwidth differs.

    python -m bench links [--requests 3] [--prompt-tokens 256,1024] [--output-tokens 8]
                          [--rates 1gbit,200mbit] [--transfer-runs 7] [--kv-formats float32] [--quick]

Writes bench/results/links.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import os
import statistics
import sys
import urllib.request
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from bench.common import kv_rig
from bench.common.kv_setting import BASELINE, MODEL_DTYPE, KVSetting, parse_settings, wire_seconds
from bench.common.links_report import print_table, setting_rows
from bench.common.remote_sender import RemoteSender
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.suites.mesh_overhead import RequestTiming, make_prompts, mesh_request, run_inprocess
from harness.host_mesh import start_host_mesh
from harness.hosts import Hosts, namespaces_unavailable
from harness.mesh import start_mesh
from harness.worker import WorkerProcess
from kvtransfer import KVLayout

WORKER_FLAGS = ["--threads", "1", "--dtype", MODEL_DTYPE]
UNCAPPED = ("loopback", "uncapped")
BACKENDS = ("torch_dist", "grpc")
SHIPPED = "tandem:kv_transfer_bytes_total"


def _time_requests(gateway_address: str, prompts: list[list[int]], output_tokens: int) -> list[RequestTiming]:
    """Every prompt through the gateway; the first one (a warm-up) is dropped."""
    from services.client import TandemClient

    with TandemClient(gateway_address) as client:
        return [mesh_request(client, prompt, output_tokens) for prompt in prompts][1:]


def _shipped_bytes(prefill: WorkerProcess) -> float:
    """The KV bytes the prefill worker's senders have delivered so far (its /metrics)."""
    with urllib.request.urlopen(f"http://{prefill.metrics_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == SHIPPED)


def _time_sizes(gateway_address: str, prefill: WorkerProcess, prompt_sets: dict[int, list[list[int]]],
                output_tokens: int) -> dict[int, tuple[list[RequestTiming], float]]:
    """Per prompt size: the timed requests, and the KV bytes shipped per prompt token (the warm-up's
    included: every prompt is new to both workers, so each ships its whole KV but a window's head or
    the blocks a budget drops)."""
    sizes = {}
    for size, prompts in prompt_sets.items():
        before = _shipped_bytes(prefill)
        timed = _time_requests(gateway_address, prompts, output_tokens)
        sizes[size] = timed, (_shipped_bytes(prefill) - before) / sum(len(prompt) for prompt in prompts)
    return sizes


def _link_figures(timed: list[RequestTiming], bytes_per_token: float, transfer_s: float, wire_s: float | None) -> dict:
    waits = [t.delivery_wait_s for t in timed if t.delivery_wait_s is not None]
    wait = statistics.median(waits) if waits else None
    return {
        "ttft_s": statistics.median(t.ttft_s for t in timed),
        "delivery_wait_s": wait,
        "kv_bytes_per_token": bytes_per_token,
        "transfer_alone_s": transfer_s,
        "wire_s": wire_s,
        "hidden": None if wait is None or not transfer_s else min(1.0, max(0.0, 1.0 - wait / transfer_s)),
    }


def _transfers(sender_wrapper: list[str], bind_host: str, runs: int,
               layout: KVLayout = kv_rig.LAYOUT) -> dict[str, dict[str, float]]:
    """Median seconds of the rig's prompt in `layout` from a sender started behind `sender_wrapper` to
    receivers on `bind_host`, per backend and per `--kv-checksum` (the same at both ends); the on and
    off runs alternate, so that both see the same moments of a noisy machine."""
    from kvtransfer.receiver import make_receiver

    sender = RemoteSender(sender_wrapper, layout.dtype)
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
                    receiver, stop = kv_rig.serve_grpc(layout, checksum=checksum, host=bind_host)
                    stops += [receiver.close, stop]
                pairs[checksum] = kv_rig.BackendRun(sender, receiver, layout, checksum)  # type: ignore[arg-type]
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


def _link(sizes: dict[int, tuple[list[RequestTiming], float]], transfers: dict[str, dict[str, float]],
          layout: KVLayout, link: str) -> dict:
    """One link's figures: per prompt size against the torch_dist transfer alone (checksum on, the
    mesh's setting) scaled to the bytes the size shipped, and the transfers."""
    per_byte = transfers["torch_dist"]["on"] / kv_rig.total_bytes(layout)
    requests = {}
    for size, (timed, bytes_per_token) in sizes.items():
        shipped = bytes_per_token * size
        wire = None if link in UNCAPPED else wire_seconds(shipped, link)
        requests[size] = _link_figures(timed, bytes_per_token, per_byte * shipped, wire)
    return {"requests": requests, "transfers": transfers}


def _prompt_sets(sizes: list[int], requests: int, link: int) -> dict[int, list[list[int]]]:
    """Each size's prompts (a warm-up and `requests`) for the `link`-th link, unlike every other
    link's: a prompt seen before would be answered from a worker's prefix cache, with no transfer."""
    return {size: make_prompts(requests + 1, size, seed=1000 * link + size) for size in sizes}


def run_loopback(prompt_sets: dict[int, list[list[int]]], output_tokens: int, transfer_runs: int) -> dict:
    """Phase 2."""
    mesh = start_mesh(worker_flags=WORKER_FLAGS, gateway_flags=["--ttft-slo-ms", "600000"])
    try:
        sizes = _time_sizes(str(mesh.gateway.address), mesh.prefill[0], prompt_sets, output_tokens)
    finally:
        mesh.stop()
    return _link(sizes, _transfers([], "127.0.0.1", transfer_runs), kv_rig.LAYOUT, "loopback")


def run_hosts(settings: list[KVSetting], sizes: list[int], requests: int, output_tokens: int, rates: list[str],
              transfer_runs: int) -> dict[str, dict[str, dict]]:
    """Phase 3: per KV setting, one mesh across three hosts, each link condition in turn; the figures
    by setting and link."""
    hosts = Hosts(["gateway", "prefill-1", "decode-1"])
    figures: dict[str, dict[str, dict]] = {}
    try:
        for setting in settings:
            layout = kv_rig.layout_of(setting.dtype)
            mesh = start_host_mesh(hosts, [*WORKER_FLAGS, *setting.worker_flags()],
                                   decode_flags={"decode-1": ["--kv-backend", "torch_dist"]},
                                   gateways={"gateway": ["decode-1"]}, gateway_flags=["--ttft-slo-ms", "600000"],
                                   prefill_hosts=["prefill-1"])
            figures[setting.label] = {}
            try:
                address = str(mesh.gateways["gateway"].address)
                for link, rate in enumerate(["uncapped", *rates], start=1):
                    if rate == "uncapped":
                        hosts.uncap("prefill-1")
                    else:
                        hosts.cap("prefill-1", rate)
                    print(f"  KV {setting.label}, link {rate} ...", flush=True)
                    timed = _time_sizes(address, mesh.prefill["prefill-1"],
                                        _prompt_sets(sizes, requests, link), output_tokens)
                    transfers = _transfers(hosts.exec_argv("prefill-1"), hosts.client_address, transfer_runs, layout)
                    figures[setting.label][rate] = _link(timed, transfers, layout, rate)
            finally:
                mesh.stop()
        return figures
    finally:
        hosts.close()


def main(argv: Sequence[str]) -> int:
    """The three phases in turn, the tables, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--requests", type=int, default=3, help="timed requests per link and size (after a warm-up)")
    parser.add_argument("--prompt-tokens", default="256,1024", help="prompt sizes, comma-separated")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rates", default="1gbit,200mbit", help="tc rates the prefill host's link is capped at")
    parser.add_argument("--transfer-runs", type=int, default=7, help="timed transfers alone per link and setting")
    parser.add_argument("--kv-formats", default=BASELINE.label,
                        help="KV settings of the hosts phase, comma-separated, FORMAT[+wWINDOW[+sSINKS]] "
                             f"(e.g. {BASELINE.label},int8,int4,int4+w256); the first, the baseline, {BASELINE.label}")
    parser.add_argument("--quick", action="store_true", help="1 request, 32-token prompts, 2 output tokens, "
                                                             "1 transfer, 200mbit only")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_tokens, args.output_tokens, args.transfer_runs = 1, "32", 2, 1
        args.rates = "200mbit"
    if args.output_tokens < 2:
        parser.error("--output-tokens must be at least 2 (TPOT needs two tokens)")
    try:
        settings = parse_settings(args.kv_formats)
    except ValueError as error:
        parser.error(str(error))
    if settings[0] != BASELINE:
        parser.error(f"--kv-formats: the first setting is the baseline, {BASELINE.label}, "
                     f"the KV of phases 1 and 2 (got {settings[0].label})")
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
    if shape["dtype"] != MODEL_DTYPE:
        print(f"warning: the in-process engine's KV is {shape['dtype']}, the workers' {MODEL_DTYPE}", file=sys.stderr)
    print("phase 2/3: loopback mesh ...", flush=True)
    loopback = run_loopback(prompt_sets, args.output_tokens, args.transfer_runs)
    print("phase 3/3: hosts ...", flush=True)
    hosts = run_hosts(settings, sizes, args.requests, args.output_tokens, rates, args.transfer_runs)
    loads["end"] = load_average()
    print_table(args, in_process, loopback, hosts, loads)
    write_results(results_path(__name__, args.quick), {
        "command": command_line(__name__, argv), "settings": vars(args), "load_average": loads,
        "kv_dtype": MODEL_DTYPE, "engine_kv_shape": shape, "in_process_ttft_s": in_process,
        "links": {"loopback": loopback, **hosts[BASELINE.label]}, "kv_settings": hosts,
        "kv_setting_rows": setting_rows(hosts),
        "note": "no latency injected: the kernel has no netem; links differ in bandwidth only",
    })
    return 0
