"""Soak: a real mesh under steady mixed load with random client cancellations for a long time
(30 minutes by default), watching for slow leaks.

The load is the cancellation storm's (harness/storm.py: shared prompt prefixes, a quarter
of the clients over HTTP, half of the requests cancelled before prefill, during the KV transfer or
mid-decode), sent closed-loop by --concurrency clients until the time is up, or open-loop at
Poisson arrivals of --rate requests/s (a sustained rate, such as the chat workload's goodput).
`--lengths chat` gives its requests the goodput benchmark's chat lengths (prompts of 128-384
tokens, outputs of 32-96) instead of the storm's short ones; `--shape flexible` soaks the default
deployment's shape (`--colocated` colocated workers placing each request aggregated or split)
instead of --prefill and --decode pools. Every --sample-s it records each process's RSS (/proc),
each worker's KV blocks held by requests (LoadReport used_kv_blocks) and the outcomes so far.

Verdict, all three needed:
- flat memory: for every process, the least-squares slope of its RSS over the last two thirds of
  the run (the first third is warm-up: allocator pools and caches fill), times that window's
  length, is at most max(32 MiB, 5% of its median RSS in the window);
- zero leaked blocks: once the load stops every worker is idle (no request, no block held beyond
  its prefix cache) within a minute;
- zero errors: every request completed with all its tokens or was cancelled by its own client.

    python -m bench soak [--minutes 30] [--concurrency 6 | --rate R] [--lengths storm|chat]
                         [--shape disagg|flexible] [--sample-s 15] [--cancel-fraction 0.5] [--smoke]

Writes bench/results/soak.json (--smoke: 1 minute, one worker per pool, a sample every 2 s, its
results under bench/results/smoke/); exits 1 unless the verdict passes. `make soak` runs it (it is not
part of `make bench`).
"""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from bench.common.suite import suite_parser
from bench.common.verdict import finish
from harness.leak_check import is_idle, load_report, wait_until_idle
from harness.load_clients import LoadRequest, LoadRunner, Outcome
from harness.mesh import Mesh, start_mesh
from harness.process_memory import rss_bytes
from harness.storm import NO_SLO, StormConfig, calm_ttft, outcome_problems, plan_storm

FLAT_FLOOR_BYTES = 32 << 20
FLAT_FRACTION = 0.05
WARM_UP_FRACTION = 1 / 3
PLAN_BATCH = 500
# The goodput benchmark's chat lengths (bench/common/workload.py CHAT), as storm requests: a shared
# 64-token prefix plus 64-320 tokens of its own, 32-96 tokens out.
CHAT_LENGTHS = {"prefix_blocks": 4, "suffix_tokens": (64, 320), "max_tokens": (32, 96)}
MAX_IN_FLIGHT = 256  # open loop: client threads sending at once (arrivals beyond them queue in the client)


def rss_growth(samples: list[tuple[float, int]]) -> tuple[float, float]:
    """(fitted growth over the window after warm-up, the growth allowed there) for one process's
    (seconds, RSS bytes) samples."""
    end = samples[-1][0]
    window = [(t, rss) for t, rss in samples if t >= end * WARM_UP_FRACTION]
    if len(window) < 2:
        return 0.0, float(FLAT_FLOOR_BYTES)
    times, values = zip(*window, strict=True)
    slope = statistics.linear_regression(times, values).slope if len(set(times)) > 1 else 0.0
    return slope * (times[-1] - times[0]), max(FLAT_FLOOR_BYTES, FLAT_FRACTION * statistics.median(values))


def endless_plan(config: StormConfig, ttft_s: float) -> Iterator[LoadRequest]:
    """The storm's requests, batch after batch, each batch from its own seed."""
    for batch in itertools.count():
        plan = plan_storm(StormConfig(**{**vars(config), "requests": PLAN_BATCH, "seed": config.seed + batch}), ttft_s)
        yield from (planned.request for planned in plan)


class Load:
    """The plan's requests sent until `stop()`: closed loop by `concurrency` client threads, or
    (with `rate`) open loop at Poisson arrivals of `rate` per second; `outcomes` grows as they end."""

    def __init__(self, runner: LoadRunner, plan: Iterator[LoadRequest], concurrency: int,
                 rate: float | None = None, seed: int = 0) -> None:
        self.outcomes: list[Outcome] = []
        self._runner, self._plan = runner, plan
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        targets = [self._client] * concurrency if rate is None else [lambda: self._arrivals(rate, seed)]
        self._threads = [threading.Thread(target=target, daemon=True) for target in targets]
        for thread in self._threads:
            thread.start()

    def _next(self) -> LoadRequest:
        with self._lock:
            return next(self._plan)

    def _run(self, request: LoadRequest) -> None:
        outcome = self._runner.run(request)
        with self._lock:
            self.outcomes.append(outcome)

    def _client(self) -> None:
        while not self._stopped.is_set():
            self._run(self._next())

    def _arrivals(self, rate: float, seed: int) -> None:
        gaps = random.Random(seed)
        due = time.monotonic()
        with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:  # leaving it waits for the requests in flight
            while not self._stopped.wait(max(0.0, due - time.monotonic())):
                pool.submit(self._run, self._next())
                due += gaps.expovariate(rate)

    def counts(self) -> Counter:
        """Outcomes so far by status."""
        with self._lock:
            return Counter(outcome.status for outcome in self.outcomes)

    def stop(self) -> None:
        """Send nothing more and wait for the requests in flight to end."""
        self._stopped.set()
        for thread in self._threads:
            thread.join()


def names(mesh: Mesh) -> dict[str, int]:
    """A short name for every process, and its pid."""
    named = {f"prefill{i}": w.proc.pid for i, w in enumerate(mesh.prefill)}
    named |= {f"decode{i}": w.proc.pid for i, w in enumerate(mesh.decode)}
    named |= {f"worker{i}": w.proc.pid for i, w in enumerate(mesh.colocated)}
    return named | {"gateway": mesh.gateway.proc.pid}


def placement_counts(mesh: Mesh) -> dict[str, float]:
    """The gateway's requests placed so far by kind (aggregated, disaggregated): the flexible shape's
    soak should exercise both."""
    with urllib.request.urlopen(f"http://{mesh.gateway.http_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return dict(Counter({s.labels["kind"]: s.value for family in text_string_to_metric_families(text)
                         for s in family.samples if s.name == "tandem:placements_total"}))


def main(argv: Sequence[str]) -> int:
    """Load a fresh mesh for the given time, sampling it; 0 when the verdict passes."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=6, help="clients, each with one request at a time")
    parser.add_argument("--rate", type=float, default=None, help="open loop instead: Poisson arrivals of this "
                        "many requests/s (e.g. the chat workload's goodput)")
    parser.add_argument("--lengths", choices=("storm", "chat"), default="storm",
                        help="the storm's short requests, or the goodput benchmark's chat lengths")
    parser.add_argument("--shape", choices=("disagg", "flexible"), default="disagg",
                        help="--prefill and --decode pools, or --colocated workers placing each request")
    parser.add_argument("--colocated", type=int, default=2, help="colocated workers (--shape flexible)")
    parser.add_argument("--sample-s", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--cancel-fraction", type=float, default=0.5,
                        help="share of requests their clients cancel (0 tells a leak on cancellation from others)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="1 minute, a sample every 2 s, one worker per pool; "
                        "results under results/smoke/")
    args = parser.parse_args(argv)
    if args.rate is not None and args.rate <= 0:
        parser.error(f"--rate: must be positive, got {args.rate}")
    if args.smoke:
        args.minutes, args.sample_s, args.prefill, args.decode = 1.0, 2.0, 1, 1
    lengths = CHAT_LENGTHS if args.lengths == "chat" else {}
    config = StormConfig(concurrency=args.concurrency, cancel_fraction=args.cancel_fraction, seed=args.seed,
                         **lengths)

    # The flexible shape is the default deployment's: its workers keep their default KV budget.
    if args.shape == "flexible":
        mesh = start_mesh(0, 0, ("--threads", "1"), gateway_flags=NO_SLO, colocated=args.colocated)
    else:
        mesh = start_mesh(args.prefill, args.decode, gateway_flags=NO_SLO)
    pids = names(mesh)
    workers = dict(zip(list(pids)[:-1], mesh.workers, strict=True))
    samples: list[dict] = []
    try:
        with LoadRunner(str(mesh.gateway.address), str(mesh.gateway.http_address)) as runner:
            load = Load(runner, endless_plan(config, calm_ttft(runner, config)), args.concurrency, args.rate,
                        args.seed)
            started = time.monotonic()
            print(f"{'t (s)':>7}  RSS MiB " + " ".join(f"{n:>8}" for n in pids) + "  | KV blocks held "
                  + " ".join(f"{n:>8}" for n in workers) + "  | outcomes")
            while True:
                now = time.monotonic() - started
                sample = {"t": now, "rss": {n: rss_bytes(pid) for n, pid in pids.items()},
                          "kv_blocks": {n: load_report(w).used_kv_blocks for n, w in workers.items()},
                          "outcomes": dict(load.counts())}
                samples.append(sample)
                print(f"{now:>7.0f}          " + " ".join(f"{b >> 20:>8}" for b in sample["rss"].values())
                      + "                  " + " ".join(f"{b:>8}" for b in sample["kv_blocks"].values())
                      + f"  | {sample['outcomes']}", flush=True)
                if now >= args.minutes * 60:
                    break
                time.sleep(min(args.sample_s, max(0.0, args.minutes * 60 - now)))
            load.stop()
            idle = wait_until_idle(mesh.workers)
            placements = placement_counts(mesh)
    finally:
        codes = mesh.stop()

    growth = {n: rss_growth([(s["t"], s["rss"][n]) for s in samples]) for n in pids}
    for n, (grown, allowed) in growth.items():
        print(f"{n}: RSS {'+' if grown >= 0 else ''}{grown / 2**20:.1f} MiB over the last two thirds "
              f"(allowed {allowed / 2**20:.0f} MiB)")
    problems = [f"{n}: RSS grew {grown / 2**20:.1f} MiB over the last two thirds, more than {allowed / 2**20:.0f} MiB"
                for n, (grown, allowed) in growth.items() if grown > allowed]
    problems += [f"leaked: {r.worker_id} used_kv_blocks={r.used_kv_blocks} running={r.running_requests} "
                 f"waiting={r.waiting_requests} reserved={r.reserved_requests}" for r in idle if not is_idle(r)]
    problems += outcome_problems(load.outcomes)
    problems += [f"{name} exited with {code}" for name, code in codes.items() if code]
    print(f"{len(load.outcomes)} requests: {dict(load.counts())}; placed {placements}")
    return finish(__name__, argv, {
        "settings": vars(args), "samples": samples,
        "rss_growth_bytes": {n: {"fitted": g, "allowed": a} for n, (g, a) in growth.items()},
        "outcomes": dict(load.counts()), "placements": placements,
    }, problems, "flat memory, no leaked blocks, no errors besides deliberate cancellations", args.smoke)

