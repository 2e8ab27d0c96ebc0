"""The cancellation storm at benchmark size: 1,000 requests (half cancelled by their clients before
prefill, during the KV transfer or mid-decode; a quarter over HTTP) through a real mesh of two prefill
and two decode workers behind a gateway, prefix caching on. The same driver as the CI test
(tests/integration/storm.py, 200 requests): the run passes when nothing leaked, every request that was
not cancelled got all its tokens and the mesh answers a greedy request as it did before the storm.

    python bench/cancel_storm.py [--requests 1000] [--concurrency 16] [--seed 0] [--smoke]

Writes bench/results/cancel_storm.json (not in --smoke mode) and exits 1 when the storm found a problem.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "integration")]
from mesh_launcher import start_mesh  # noqa: E402
from reliability_verdict import finish  # noqa: E402
from storm import StormConfig, run_storm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="40 requests, 4 at a time, one worker per pool; "
                        "nothing written")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.concurrency, args.prefill, args.decode = 40, 4, 1, 1
    config = StormConfig(requests=args.requests, concurrency=args.concurrency, seed=args.seed)
    mesh = start_mesh(args.prefill, args.decode, gateway_flags=["--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"])
    try:
        report = run_storm(mesh, config)
    finally:
        codes = mesh.stop()
    problems = report.problems() + [f"{name} exited with {code}" for name, code in codes.items() if code]
    print(report.summary())
    return finish("cancel_storm", {
        "settings": vars(args), "seconds": report.seconds,
        "counts": [{"cancel": p, "api": a, "outcome": o, "requests": n} for (p, a, o), n in report.counts.items()],
        "prefix_hit_tokens": report.prefix_hit_tokens, "prefills_undelivered": report.prefills_undelivered,
    }, problems, "no leaks, no errors, the mesh serves as before", args.smoke)


if __name__ == "__main__":
    sys.exit(main())
