"""What routing costs the gateway per request, with 100 requests queued.

Times the router's pure decision (`services.gateway.router.route`) over a 2-prefill + 2-decode
view with a 1,000-token prompt and a prefix index entry, and one drain of the admission queue
holding 100 waiting requests (every one re-decided, none placed: the worst case, since a placed
request leaves the queue). Baseline in the same run: the time of an empty Python call, to show the
clock's floor. Target: ≤ 1 ms per request at 100 queued.

    python -m bench routing_overhead [--repeats 2000]

Prints the medians and writes bench/results/routing_overhead.json.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence

from bench.common.call_timer import drain_s, median_call_s
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from services.common.step_model import StepModel
from services.gateway.admission import Admission
from services.gateway.router import Decision, RouteRequest, SloTargets, WorkerView, route

MODEL = StepModel(base_s=0.06, per_prompt_token_s=0.004, per_sequence_s=0.015, per_context_token_s=1e-6)
WORKERS = [
    WorkerView("p1", "prefill", queued_prompt_tokens=900, free_kv_blocks=4000, block_size=16, step_model=MODEL,
               chunk_tokens=2048),
    WorkerView("p2", "prefill", queued_prompt_tokens=300, free_kv_blocks=4000, block_size=16, step_model=MODEL,
               chunk_tokens=2048),
    WorkerView("d1", "decode", sequences=6, context_tokens=3000, free_kv_blocks=900, block_size=16, step_model=MODEL),
    WorkerView("d2", "decode", sequences=3, context_tokens=1500, free_kv_blocks=2000, block_size=16, step_model=MODEL),
]
QUEUED = 100
TARGET_S = 1e-3  # per request, with QUEUED waiting
REQUEST = RouteRequest(prompt_tokens=1000, max_tokens=64, slo=SloTargets(2.0, 0.1), cached_tokens={"p2": 512})


class Busy:
    """A placer whose workers never have room: every waiter is re-decided on every drain."""

    def decide(self, request: RouteRequest, idle: bool = False) -> Decision:
        decision = route(request, WORKERS)
        return Decision(decision.decode, decision.prefill, decision.ttft_s, decision.tpot_s, idle, decision.cost,
                        decision.reasons)

    def claim(self, request: RouteRequest, decision: Decision) -> object:
        raise AssertionError("nothing is placed in this benchmark")


async def drain_seconds(queued: int) -> float:
    admission = Admission(Busy(), max_queued=queued)
    waiting = [asyncio.create_task(admission.admit(REQUEST, arrived_at=time.monotonic() + 3600))
               for _ in range(queued)]
    await asyncio.sleep(0)
    assert admission.queued == queued
    return await drain_s(admission, waiting)


def main(argv: Sequence[str]) -> int:
    """Time the empty call, one decision and the drains; print and write their medians."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls of each kind")
    parser.add_argument("--drains", type=int, default=20, help="timed drains of the queue")
    args = parser.parse_args(argv)

    empty = median_call_s(lambda: None, args.repeats)
    one = median_call_s(lambda: route(REQUEST, WORKERS), args.repeats)
    drain = statistics.median(asyncio.run(drain_seconds(QUEUED)) for _ in range(args.drains))
    load = load_average()
    met = drain / QUEUED <= TARGET_S
    print(f"load average {load}; medians")
    print(f"empty call:                       {empty * 1e6:8.2f} us")
    print(f"one routing decision (2P + 2D):   {one * 1e6:8.2f} us")
    print(f"drain of {QUEUED} queued requests:     {drain * 1e3:8.3f} ms = {drain / QUEUED * 1e6:.1f} us per request "
          f"(target <= 1 ms per request: {'met' if met else 'MISSED'})")
    write_results(results_path(__name__), {
        "command": command_line(__name__, argv), "load_average": load,
        "median_s": {"empty_call": empty, "decision": one, f"drain_{QUEUED}_queued": drain},
        "per_request_in_drain_s": drain / QUEUED, "target_s": TARGET_S, "target_met": met,
    })
    return 0
