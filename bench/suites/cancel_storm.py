"""The cancellation storm at benchmark size, 1,000 requests through a real mesh, half of them cancelled.

Half of the requests are cancelled by their clients before prefill, during the KV transfer or
mid-decode, a quarter go over HTTP, through a real mesh of two prefill and two decode workers behind
a gateway, prefix caching on. The same driver as the CI test
(harness/storm.py; tests/integration/test_cancel_storm.py sends 200 requests): the run passes
when nothing leaked, every request that was not cancelled got all its tokens and the mesh answers a
greedy request as it did before the storm.

    python -m bench cancel_storm [--requests 1000] [--concurrency 16] [--seed 0] [--smoke]

Writes bench/results/cancel_storm.json (a --smoke run's under bench/results/smoke/) and exits 1 when
the storm found a problem.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.common.suite import suite_parser
from bench.common.verdict import finish
from harness.mesh import start_mesh
from harness.storm import NO_SLO, StormConfig, run_storm


def main(argv: Sequence[str]) -> int:
    """Run the storm against a fresh mesh; 0 when it passed."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="40 requests, 4 at a time, one worker per pool; "
                        "results under results/smoke/")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.prefill, args.decode = 40, 4, 1, 1
    config = StormConfig(requests=args.requests, concurrency=args.concurrency, seed=args.seed)
    mesh = start_mesh(args.prefill, args.decode, gateway_flags=NO_SLO)
    try:
        report = run_storm(mesh, config)
    finally:
        codes = mesh.stop()
    problems = report.problems() + [f"{name} exited with {code}" for name, code in codes.items() if code]
    print(report.summary())
    return finish(__name__, argv, {
        "settings": vars(args), "seconds": report.seconds,
        "counts": [{"cancel": p, "api": a, "outcome": o, "requests": n} for (p, a, o), n in report.counts.items()],
        "prefix_hit_tokens": report.prefix_hit_tokens, "prefills_undelivered": report.prefills_undelivered,
    }, problems, "no leaks, no errors, the mesh serves as before", args.smoke)

