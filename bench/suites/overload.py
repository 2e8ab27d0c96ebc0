"""Whether requests the gateway admits keep their objectives while a burst at ten times the mesh's
capacity is refused around them.

One mesh (a prefill and a decode worker behind a gateway with a bounded admission queue), one run:

1. Objectives from the workers' step models (harness/burst.py: TTFT = 3 prompts' prefill,
   TPOT = 4 decode steps of the request alone); every request carries them.
2. Capacity: requests sent back to back, as many at once as the TTFT objective holds; capacity is
   the rate at which they completed (requests per second).
3. Without the burst: probe requests arrive at half that rate (open loop, evenly spaced).
4. With the burst: probe requests of the same kind on the same schedule (new prompts, so that no
   prefix cache favours either phase), while burst requests arrive at ten times the capacity for
   the same time. Every prompt is distinct, half of the requests go through HTTP.

Attainment is measured at the client (TTFT from sending to the first token, TPOT the mean gap after
it) over the admitted requests (those that completed); refusals are RESOURCE_EXHAUSTED / HTTP 429.
The gateway's RSS is sampled throughout. Afterwards the workers must hold nothing and a request
through each API must be served.

    python -m bench overload [--probes 40] [--burst-factor 10] [--max-queued 8] [--smoke]

Writes bench/results/overload.json (a --smoke run's under bench/results/smoke/); exits 1 on an error,
a leak or a failed request after the burst.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from bench.common.suite import suite_parser
from bench.common.verdict import finish
from harness.burst import Objectives, burst_requests, objectives
from harness.leak_check import is_idle, wait_until_idle
from harness.load_clients import ERROR, OK, REFUSED, LoadRunner, Outcome
from harness.mesh import start_mesh
from harness.process_memory import RssSampler

PROMPT_TOKENS = 256
MAX_TOKENS = 16
TTFT_FACTOR = 3.0


def attainment(outcomes: list[Outcome], slo: Objectives) -> dict[str, float | int]:
    """Counts by outcome and, over the admitted (completed) requests, the fractions meeting each objective."""
    admitted = [o for o in outcomes if o.status == OK]
    met = [slo.attained(o) for o in admitted]

    def share(hits: int) -> float:
        return hits / len(admitted) if admitted else float("nan")

    return {
        "sent": len(outcomes), "admitted": len(admitted),
        "refused": sum(o.status == REFUSED for o in outcomes), "errors": sum(o.status == ERROR for o in outcomes),
        "ttft_met": share(sum(t for t, _ in met)), "tpot_met": share(sum(p for _, p in met)),
        "both_met": share(sum(t and p for t, p in met)),
    }


def measure_capacity(runner: LoadRunner, slo: Objectives, requests: int, seed: int) -> float:
    """Requests per second completed when sent back to back, TTFT_FACTOR at a time."""
    started = time.monotonic()
    outcomes = runner.run_all(burst_requests(requests, PROMPT_TOKENS, MAX_TOKENS, slo, seed), int(TTFT_FACTOR))
    completed = sum(o.status == OK for o in outcomes)
    if not completed:
        raise RuntimeError(f"no request completed while measuring capacity: {outcomes[0]}")
    return completed / (time.monotonic() - started)


def main(argv: Sequence[str]) -> int:
    """Measure capacity, then probes without and with the burst; 0 when nothing went wrong."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--probes", type=int, default=40, help="probe requests per phase")
    parser.add_argument("--capacity-requests", type=int, default=24, help="requests timed to measure capacity")
    parser.add_argument("--burst-factor", type=float, default=10.0, help="burst rate as a multiple of capacity")
    parser.add_argument("--max-queued", type=int, default=8, help="the gateway's --max-queued-requests")
    parser.add_argument("--smoke", action="store_true", help="4 probes, 4 capacity requests; results under "
                        "results/smoke/")
    args = parser.parse_args(argv)
    if args.smoke:
        args.probes, args.capacity_requests = 4, 4

    mesh = start_mesh(1, 1, gateway_flags=["--max-queued-requests", str(args.max_queued)])
    try:
        rss = RssSampler({"gateway": mesh.gateway.proc.pid}, interval_s=0.2).start()
        with LoadRunner(str(mesh.gateway.address), str(mesh.gateway.http_address)) as runner:
            slo = objectives(mesh, PROMPT_TOKENS, MAX_TOKENS, ttft_factor=TTFT_FACTOR)
            capacity = measure_capacity(runner, slo, args.capacity_requests, seed=1)
            gap = 2.0 / capacity  # probes at half the capacity
            window = args.probes * gap
            calm = runner.run_at([(i * gap, r) for i, r in enumerate(
                burst_requests(args.probes, PROMPT_TOKENS, MAX_TOKENS, slo, seed=2))])
            calm_rss = rss.peak("gateway")
            burst_count = round(args.burst_factor * capacity * window)
            schedule = [(i * gap, r, "probe") for i, r in enumerate(
                burst_requests(args.probes, PROMPT_TOKENS, MAX_TOKENS, slo, seed=3))]
            schedule += [(i * window / burst_count, r, "burst") for i, r in enumerate(
                burst_requests(burst_count, PROMPT_TOKENS, MAX_TOKENS, slo, seed=4))]
            schedule.sort(key=lambda item: item[0])
            outcomes = runner.run_at([(offset, request) for offset, request, _ in schedule])
            burst_rss = rss.peak("gateway")
            idle = wait_until_idle(mesh.workers)
            after = [runner.run(r) for r in burst_requests(2, PROMPT_TOKENS, MAX_TOKENS, slo, seed=5)]
        rss.stop()
    finally:
        codes = mesh.stop()

    kinds = [kind for _, _, kind in schedule]
    rows = {
        "probes without the burst": attainment(calm, slo),
        "probes during the burst": attainment([o for o, k in zip(outcomes, kinds, strict=True) if k == "probe"], slo),
        "burst requests": attainment([o for o, k in zip(outcomes, kinds, strict=True) if k == "burst"], slo),
    }
    problems = [f"{name}: {row['errors']} errors" for name, row in rows.items() if row["errors"]]
    problems += [f"leaked: {r.worker_id} used_kv_blocks={r.used_kv_blocks} running={r.running_requests}"
                 for r in idle if not is_idle(r)]
    problems += [f"after the burst, a {o.request.api} request: {o.status} {o.detail}" for o in after
                 if (o.status, o.tokens) != (OK, MAX_TOKENS)]
    problems += [f"{name} exited with {code}" for name, code in codes.items() if code]

    print(f"objectives: TTFT {slo.ttft_ms} ms, TPOT {slo.tpot_ms} ms ({PROMPT_TOKENS}-token prompts, {MAX_TOKENS} "
          f"tokens); capacity {capacity:.2f} req/s (measured); probes at {1 / gap:.2f} req/s, burst "
          f"{burst_count} requests at {burst_count / window:.2f} req/s for {window:.1f} s; "
          f"--max-queued-requests {args.max_queued}")
    print(f"{'':<26}{'sent':>6}{'admitted':>10}{'refused':>9}{'errors':>8}{'TTFT met':>10}{'TPOT met':>10}"
          f"{'both met':>10}   (met: share of admitted)")
    for name, row in rows.items():
        print(f"{name:<26}{row['sent']:>6}{row['admitted']:>10}{row['refused']:>9}{row['errors']:>8}"
              f"{row['ttft_met']:>10.1%}{row['tpot_met']:>10.1%}{row['both_met']:>10.1%}")
    print(f"gateway RSS: {rss.samples[0][1]['gateway'] >> 20} MiB at the start, peak {calm_rss >> 20} MiB without "
          f"the burst, {burst_rss >> 20} MiB with it")
    return finish(__name__, argv, {
        "settings": vars(args), "objectives_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
        "capacity_rps": capacity, "burst": {"requests": burst_count, "seconds": window}, "phases": rows,
        "gateway_rss_bytes": {"start": rss.samples[0][1]["gateway"], "peak_calm": calm_rss, "peak_burst": burst_rss},
    }, problems, "no errors, nothing leaked, the mesh serves after the burst", args.smoke)

