"""What a hot swap of a model version does to TTFT and TPOT p99 under steady load.

One mesh as in tests/integration/test_model_repository.py: the shipped model as two versions in one
repository file, q4 (the file's own 4-bit blocks) on a prefill and a decode worker, fp32 on a
colocated worker, and a gateway that follows the file (each process its own, one torch thread).
Closed-loop clients (--clients, each sending its next request when its last one ended) ask for the
model's name, so the file's split picks the version of every request; the requests are short and
greedy (distinct random prompts of --prompt-tokens, exactly --max-tokens tokens). Under that load,
back to back:

1. warm-up (--warmup-s, not counted);
2. steady: --steady-s seconds at the file's split, q4 50 / fp32 50;
3. swap, --swaps times back to back (one swap holds few requests; more give its p99 more): the
   split moves to fp32 100 in the file; once the latest replies all came from fp32, the q4 workers
   are stopped (SIGTERM: each drains what it holds) and started again on the same ports; once the
   gateway routes a q4 request to them (a probe, not counted), the split moves back to 50 / 50; a
   swap ends when q4 serves the load again;
4. after: --after-s seconds at 50 / 50.

With --in-process the colocated worker swaps in its own process instead (services.decode.model_swap:
it takes its version by pool, under a memory limit): the file assigns its pool an int8 version, which
loads beside fp32 (both served); the split moves from fp32 to int8 and fp32 is unloaded; then the
same two edits back to fp32. No process restarts.

A request counts in the phase it started in, and in the step of a swap it started in (those rows
show where a swap costs); TTFT and TPOT are measured at the client. Failed (an error) and short
(fewer than --max-tokens tokens) requests are counted. The gateway's objectives are out of reach of
refusal, as in the integration test: this measures latency, not admission.
Targets: no failed or short request; swap p99 within 1.5x of steady.

    python -m bench hot_swap [--steady-s 90] [--swaps 3] [--after-s 30] [--clients 2] [--in-process] [--quick]

Writes bench/results/hot_swap.json (a --quick run's under bench/results/smoke/); exits 1 when a
request failed or came short, or a process exited uncleanly.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.common.metrics import percentiles
from bench.common.suite import load_average, suite_parser
from bench.common.verdict import finish
from bench.common.version_load import Sample, VersionLoad
from harness.leak_check import load_report
from harness.load_clients import random_tokens
from harness.ports import free_port
from harness.repository_files import two_versions
from harness.worker import WorkerProcess, start_worker

MODEL, Q4, FP32, INT8 = "smollm2", "smollm2@q4", "smollm2@fp32", "smollm2@int8"
COLOCATED_POOL = "smollm2-fp32"
FLAGS = ("--threads", "1", "--kv-cache-mib", "64")
P99_TARGET = 1.5
RELOAD_S = 2.0  # the gateway polls the file once a second: replies started this long after a rewrite see it
SETTLED = 4  # replies that show the traffic moved
TIMEOUT_S = 180.0  # for each step of the swap (a worker's start loads the model)

Window = tuple[str, float, float]  # a named span of time.monotonic()


def repository(q4_percent: int) -> str:
    """The repository file's text: the shipped model as q4 and fp32, q4 weighted `q4_percent`."""
    return two_versions(f"q4 = {q4_percent}, fp32 = {100 - q4_percent}", name=MODEL)


def int8_beside(split: str, int8_pool: str, fp32_pool: str) -> str:
    """The file with an int8 version as well, each version of the colocated pool's pair on the pool
    named."""
    int8 = f'[[model.version]]\nname = "int8"\npath = "shipped"\nquantization = "int8"\npool = "{int8_pool}"\n'
    return two_versions(split, f'pool = "{fp32_pool}"', name=MODEL) + int8


def rewrite(path: Path, text: str) -> None:
    """Replace the file at once, as a ConfigMap update lands: the gateway never reads half of it."""
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)


def start(path: Path, in_process: bool) -> dict[str, WorkerProcess]:
    """The mesh's processes by name (the gateway last), once every one is serving; `in_process`: the
    colocated worker follows its pool's version in the file."""
    ports = {name: free_port() for name in ("prefill", "decode", "colocated")}
    repo = ["--model-repository", str(path)]
    arg_lists = {
        "prefill": ["prefill", "--port", str(ports["prefill"]), *FLAGS, *repo, "--model-version", Q4],
        "decode": ["decode", "--port", str(ports["decode"]), *FLAGS, *repo, "--model-version", Q4],
        "colocated": ["worker", "--port", str(ports["colocated"]), *FLAGS, *repo,
                      *(("--pool", COLOCATED_POOL, "--memory-limit-mib", "8192") if in_process
                        else ("--model-version", FP32))],
        "gateway": ["gateway", "--port", "0", "--http-port", "0", *repo, "--ttft-slo-ms", "600000",
                    "--tpot-slo-ms", "600000", *(f"--{name}=127.0.0.1:{port}" for name, port in ports.items())],
    }
    processes = {name: start_worker(args, wait=False) for name, args in arg_lists.items()}
    try:
        for process in processes.values():
            process.wait_ready()
    except BaseException:
        for process in reversed(processes.values()):
            process.stop(timeout=10.0)
        raise
    return processes


def swap(processes: dict[str, WorkerProcess], path: Path, load: VersionLoad) -> tuple[list[Window], dict, int]:
    """Move the traffic to fp32, restart the q4 workers, move it back (the module docstring's step
    3); each step's window, the stopped workers' exit codes, and the probes the gateway refused."""
    windows: list[Window] = []
    begun = time.monotonic()

    def step(name: str) -> None:
        nonlocal begun
        windows.append((name, begun, time.monotonic()))
        begun = time.monotonic()

    rewrite(path, repository(0))
    load.wait_for(begun + RELOAD_S, lambda replies: len(replies) >= SETTLED and all(
        s.version == FP32 for s in replies[-SETTLED:]), "the traffic moving to fp32", TIMEOUT_S)
    step("moving to fp32")
    codes = {name: processes[name].stop() for name in ("prefill", "decode")}
    step("stopping q4")
    for name in ("prefill", "decode"):
        processes[name] = start_worker(processes[name].args, wait=False)
    for name in ("prefill", "decode"):
        processes[name].wait_ready()
    step("restarting q4")
    rng, probes = random.Random(7), 0
    while load.request(Q4, random_tokens(rng, 8), 1).error:  # until the gateway routes to the new pair
        probes += 1
        if time.monotonic() - begun > TIMEOUT_S:
            raise RuntimeError("the gateway never routed a q4 request to the restarted workers")
        time.sleep(0.5)
    step("probing q4")
    rewrite(path, repository(50))
    load.wait_for(begun + RELOAD_S, lambda replies: sum(s.version == Q4 for s in replies) >= SETTLED,
                  "q4 serving the load again", TIMEOUT_S)
    step("moving back")
    return windows, codes, probes


def swap_in_process(processes: dict[str, WorkerProcess], path: Path, load: VersionLoad) -> list[Window]:
    """fp32 -> int8 -> fp32 inside the colocated worker's process (--in-process); each step's window."""
    windows: list[Window] = []
    begun = time.monotonic()

    def step(name: str, serving: str, retiring: list[str], served: str | None = None) -> None:
        nonlocal begun
        deadline = time.monotonic() + TIMEOUT_S
        while (report := load_report(processes["colocated"])).model_version != serving or list(
                report.retiring_versions) != retiring:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the colocated worker never reported {serving} {retiring}")
            time.sleep(0.2)
        if served is not None:
            load.wait_for(begun + RELOAD_S, lambda replies: sum(s.version == served for s in replies) >= SETTLED,
                          f"{served} serving the load", TIMEOUT_S)
        windows.append((name, begun, time.monotonic()))
        begun = time.monotonic()

    rewrite(path, int8_beside("q4 = 50, fp32 = 50", COLOCATED_POOL, "standby"))
    step("loading int8", "int8", [FP32])
    rewrite(path, int8_beside("q4 = 50, int8 = 50", COLOCATED_POOL, "standby"))
    step("moving to int8", "int8", [], INT8)
    rewrite(path, int8_beside("q4 = 50, int8 = 50", "standby", COLOCATED_POOL))
    step("loading fp32", "fp32", [INT8])
    rewrite(path, repository(50))
    step("moving back", "fp32", [], FP32)
    return windows


def summary(samples: Sequence[Sample], windows: Sequence[Window], max_tokens: int) -> dict:
    """The counts of the requests started in `windows`, and their completed ones' TTFT and TPOT
    percentiles (ms)."""
    within = [s for s in samples if any(begin <= s.started_at < end for _, begin, end in windows)]
    done = [s for s in within if not s.error]
    return {
        "requests": len(within), "failed": len(within) - len(done),
        "short": sum(s.tokens < max_tokens for s in done),
        "ttft_ms": percentiles([s.ttft_s * 1e3 for s in done if s.ttft_s is not None]),
        "tpot_ms": percentiles([s.tpot_s * 1e3 for s in done if s.tpot_s is not None]),
        "by_version": dict(Counter(s.version for s in done)),
        "errors": sorted({s.error for s in within if s.error})[:5],
    }


def ratio(phase: dict, steady: dict, metric: str) -> float:
    """`phase`'s p99 of `metric` over steady's (nan without samples)."""
    top, base = phase[metric]["p99"], steady[metric]["p99"]
    return top / base if top is not None and base else float("nan")


def run(args: argparse.Namespace) -> tuple[list[Sample], dict[str, list[Window]], list[int], dict[str, int]]:
    """Start the mesh and run the phases under load: every sample, each phase's windows (a swap's
    steps too, by name), the probes refused per swap, and every exit code."""
    phases: dict[str, list[Window]] = {}
    probes, codes = [], {}
    with tempfile.TemporaryDirectory(prefix="tandem-hot-swap-") as folder:
        path = Path(folder) / "models.toml"
        path.write_text(repository(50))
        processes = start(path, args.in_process)
        try:
            load = VersionLoad(str(processes["gateway"].address), MODEL, args.clients, args.prompt_tokens,
                               args.max_tokens)
            try:
                time.sleep(args.warmup_s)
                begun = time.monotonic()
                time.sleep(args.steady_s)
                phases["steady"] = [("steady", begun, time.monotonic())]
                for number in range(args.swaps):
                    if args.in_process:
                        windows, stopped, refused = swap_in_process(processes, path, load), {}, 0
                    else:
                        windows, stopped, refused = swap(processes, path, load)
                    phases.setdefault("swap", []).append(("swap", windows[0][1], windows[-1][2]))
                    for window in windows:
                        phases.setdefault(f"  {window[0]}", []).append(window)
                    codes |= {f"{name} stopped in swap {number + 1}": code for name, code in stopped.items()}
                    probes.append(refused)
                begun = time.monotonic()
                time.sleep(args.after_s)
                phases["after"] = [("after", begun, time.monotonic())]
            finally:
                samples = load.stop()
        finally:
            codes |= {f"{name}@{p.address}": p.stop() for name, p in reversed(processes.items())}
    return samples, phases, probes, codes


def main(argv: Sequence[str]) -> int:
    """Run the phases under load; print steady against swap; 1 on a failed or short request."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--clients", type=int, default=2, help="closed-loop clients")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="seconds of load before the steady phase")
    parser.add_argument("--steady-s", type=float, default=90.0, help="seconds of the steady phase")
    parser.add_argument("--swaps", type=int, default=3, help="swaps, back to back (more requests in the swap phase)")
    parser.add_argument("--after-s", type=float, default=30.0, help="seconds of the phase after the swaps")
    parser.add_argument("--in-process", action="store_true",
                        help="swap inside the colocated worker's process (fp32 -> int8 -> fp32), no restart")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 s warm-up, 10 s steady, one swap, 5 s "
                        "after; results under results/smoke/")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup_s, args.steady_s, args.swaps, args.after_s = 3.0, 10.0, 1, 5.0

    samples, windows, probes, codes = run(args)
    phases = {name: summary(samples, phase_windows, args.max_tokens) for name, phase_windows in windows.items()}
    steady = phases["steady"]
    ratios = {name: {metric: ratio(phase, steady, metric) for metric in ("ttft_ms", "tpot_ms")}
              for name, phase in phases.items() if name != "steady"}
    seconds = {name: sum(end - begin for _, begin, end in spans) for name, spans in windows.items()}
    print(f"load average {load_average()}; {args.clients} closed-loop clients, {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} tokens each; {args.swaps} swaps (a swap's steps indented)")
    print(f"{'phase':<16}{'seconds':>8}{'requests':>9}{'failed':>7}{'short':>6}{'TTFT p50':>10}{'p99':>8}"
          f"{'TPOT p50':>10}{'p99':>8}   (ms)  served by")
    for name, phase in phases.items():
        ttft, tpot = phase["ttft_ms"], phase["tpot_ms"]
        print(f"{name:<16}{seconds[name]:>8.1f}{phase['requests']:>9}{phase['failed']:>7}{phase['short']:>6}"
              f"{ttft['p50'] or 0:>10.1f}{ttft['p99'] or 0:>8.1f}{tpot['p50'] or 0:>10.1f}{tpot['p99'] or 0:>8.1f}"
              f"         {phase['by_version']}")
    swap_ratios = ratios["swap"]
    met = all(value <= P99_TARGET for value in swap_ratios.values())
    print(f"swap p99 / steady p99: TTFT {swap_ratios['ttft_ms']:.2f}x, TPOT {swap_ratios['tpot_ms']:.2f}x "
          f"(target <= {P99_TARGET}x: {'met' if met else 'MISSED'})")
    problems = [f"{name}: {phase['failed']} failed ({'; '.join(phase['errors'])}), {phase['short']} short"
                for name, phase in phases.items() if phase["failed"] or phase["short"]]
    problems += [f"{name} exited with {code}" for name, code in codes.items() if code]
    return finish(__name__, argv, {
        "settings": vars(args), "load_average": load_average(), "seconds": seconds, "refused_probes": probes,
        "phases": phases, "p99_over_steady": ratios, "p99_target": P99_TARGET, "p99_target_met": met,
    }, problems, "no request failed or came short, every process exited cleanly", args.quick)
