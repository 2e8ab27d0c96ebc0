"""Planner simulation: a simulated day of traffic against the planner's own rules, compared with an
oracle that sizes each pool perfectly.

The rules are services/gateway/planner_rules.py itself.

Demand (issue 6): 24 hours at one-minute steps. The request rate follows a sinusoid between 10% and
100% of the peak, the peak at hour 14, with Poisson noise (each minute's count is Poisson, arrivals
uniform within it; seeded). Prompts are 256 tokens and outputs 64 until hour 12, then 1,024 and 64.
The default peak, 3 requests/s, is 3,072 prompt tokens/s in the 1,024-token phase: about 11 prefill
replicas at the default capacity, and 2 decode replicas.

Capacity per replica (flags; defaults measured on this machine for SmolLM2-135M on one core by
the engine_throughput suite with --threads 1, as the goodput suite measures attainment per rate
rather than per-replica capacity): a prefill replica computes 280 prompt tokens/s (its speed on
1,024-token prompts; 256-token ones go at 340), one prompt at a time; a decode step with batch b
takes 24 ms + 5.6 ms x b (weights held at fp16), so a replica holds at most 13 sequences within
TPOT 100 ms.

The world, each minute m (from t to t + 60 s):
- Prefill: one FIFO queue in front of the ready prefill replicas; a request starts on the replica
  free soonest, once it has arrived, and takes prompt / speed. What cannot start before t + 60 s
  waits for the next minute's replicas (queues carry over). TTFT = arrival to end of prefill.
- Decode: the requests whose prefill ends in minute m arrive at the decode pool at that rate; each
  decodes 63 steps, spread evenly over the ready decode replicas. The pool's steady state (Little's
  law, step time at the mean batch) gives the minute's sequences and TPOT, which every request
  arriving at the pool in that minute gets; a pool that cannot keep up has an infinite TPOT.
- Replicas: the planner sets each pool's count (as the Deployment's `replicas`); new replicas are
  ready 3 minutes after the planner asked for them; a count cut removes not-yet-ready replicas first.
- Attainment rule: a minute attains the SLO when at least 90% of the requests that arrived in it
  have TTFT <= 2 s and TPOT <= 100 ms (a request still queued when the day ends meets neither).

The planner, at the end of each minute, sees what the real planner would (services/gateway/planner.py):
the prompt-token arrival rate over the last minute, the prompt tokens and prompts still queued, the
measured prefill speed; the decode pool's sequences, their KV blocks (prompt + half the output
each), the mean batch per ready replica, the step time at it and the step model.
prefill_replicas/decode_replicas recommend, a ScaleDecision per pool (stabilisation window,
cooldown) decides. Its configuration is the gateway's defaults (`--planner-queue-drain-s 120`,
`--planner-prefill-headroom-beta 0.6`, ...)
except the replica bounds (1:64) and the interval (one minute).

The oracle, each minute, runs the fewest replicas per pool that meet that minute's own demand at the
SLOs with no lag: prefill, the fewest idle replicas (no earlier queue) that give 90% of the minute's
requests their TTFT and compute its prompt tokens within the minute (where no count can, because one
prompt alone takes longer than the TTFT target, the throughput bound); decode, the fewest whose steady
state at the minute's arrival rate has TPOT <= 100 ms.

Output: replica-hours of planner and oracle (their ratio), the share of minutes attaining the SLO,
bench/results/planner_sim.json and the plot bench/results/planner_sim.png (docs/planner_sim.png is
the one the docs show: `--plot docs/planner_sim.png`; plotting needs matplotlib, the `bench` extra).
Target: >= 90% of minutes at <= 1.2x the oracle's replica-hours.

    python -m bench planner_sim [--peak-rate 3] [--ttft-ms 2000] [--prefill-tokens-per-s 280]
        [--decode-step-ms 24] [--decode-step-per-seq-ms 5.6] [--seed 0] [--out bench/results/planner_sim]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from bench.common.suite import command_line, results_path, suite_parser
from bench.planner.world import (
    MINUTE_S,
    Capacity,
    Demand,
    PrefillPool,
    Request,
    Targets,
    decode_steady_state,
    minute_attains,
    oracle_decode,
    oracle_prefill,
)
from engine.kv_cache.blocks import blocks_for
from services.gateway.planner_rules import (
    DecodeDemand,
    PlannerConfig,
    PoolBounds,
    PrefillDemand,
    ScaleDecision,
    decode_replicas,
    prefill_replicas,
)

READY_DELAY_S = 180.0
POOLS = ("prefill", "decode")


class Pool:
    """A pool's replica count as the planner set it, and when each of its replicas is ready."""

    def __init__(self, replicas: int) -> None:
        self.ready_at = [0.0] * replicas

    @property
    def requested(self) -> int:
        return len(self.ready_at)

    def ready(self, now_s: float) -> int:
        return sum(at <= now_s for at in self.ready_at)

    def scale(self, replicas: int, now_s: float) -> None:
        self.ready_at.sort()  # the last are the latest to be ready: removed first, as Kubernetes does
        del self.ready_at[replicas:]
        self.ready_at += [now_s + READY_DELAY_S] * (replicas - len(self.ready_at))


@dataclass
class Trace:
    """Per-minute series of one simulated day."""

    requested: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in POOLS})
    ready: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in POOLS})
    oracle: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in POOLS})
    rate: list[float] = field(default_factory=list)
    attained: list[bool] = field(default_factory=list)
    met_share: list[float] = field(default_factory=list)


def simulate(demand: Demand, capacity: Capacity, targets: Targets, config: PlannerConfig) -> Trace:
    """One day: the world minute by minute, the planner deciding at each minute's end."""
    arrivals = demand.arrivals()
    prefill = PrefillPool(capacity.prefill_tokens_per_s)
    pools = {role: Pool(getattr(config, role).min_replicas) for role in POOLS}
    decisions = {role: ScaleDecision(config.scale_down_window_s, config.cooldown_s) for role in POOLS}
    at_decode: dict[int, list[Request]] = defaultdict(list)
    trace = Trace()
    for minute, requests in enumerate(arrivals):
        start, end = minute * MINUTE_S, (minute + 1) * MINUTE_S
        ready = {role: pool.ready(start) for role, pool in pools.items()}
        for role, pool in pools.items():
            trace.requested[role].append(pool.requested)
            trace.ready[role].append(ready[role])
        prefill.resize(ready["prefill"], start)
        for request in prefill.run(requests, end):
            at_decode[int(request.prefilled_s // MINUTE_S)].append(request)
        decoding = at_decode.pop(minute, [])
        sequences, tpot = decode_steady_state(len(decoding) / MINUTE_S, ready["decode"], demand.output_tokens, capacity)
        for request in decoding:
            request.tpot_s = tpot
        if sequences == float("inf"):  # the pool falls behind: at least the minute's arrivals are running
            sequences = float(len(decoding))
        batch = sequences / max(ready["decode"], 1)
        blocks_per_sequence = blocks_for(demand.prompt_tokens(minute) + demand.output_tokens // 2, capacity.block_size)
        recommended = {
            "prefill": prefill_replicas(PrefillDemand(
                arrival_tokens_per_s=sum(r.prompt_tokens for r in requests) / MINUTE_S,
                queued_prompt_tokens=prefill.queued_prompt_tokens, queued_requests=len(prefill.waiting),
                tokens_per_s_per_replica=capacity.prefill_tokens_per_s), config),
            "decode": decode_replicas(DecodeDemand(
                sequences=round(sequences), used_kv_blocks=round(sequences * blocks_per_sequence),
                kv_blocks_per_replica=capacity.kv_blocks_per_replica, batch_per_replica=batch,
                tpot_s=capacity.decode_step_s(batch), step_base_s=capacity.decode_base_s,
                step_per_sequence_s=capacity.decode_per_sequence_s), config),
        }
        for role, pool in pools.items():
            target = decisions[role].decide(end, recommended[role], pool.requested)
            pool.scale(target, end)
        trace.oracle["prefill"].append(oracle_prefill(requests, start, capacity, targets))
        trace.oracle["decode"].append(oracle_decode(len(requests) / MINUTE_S, demand.output_tokens, capacity, targets))
        trace.rate.append(len(requests) / MINUTE_S)
    for requests in arrivals:
        trace.attained.append(minute_attains(requests, targets))
        trace.met_share.append(sum(r.meets(targets) for r in requests) / len(requests) if requests else 1.0)
    return trace


def summarize(trace: Trace, demand: Demand, capacity: Capacity, targets: Targets) -> dict:
    """Replica-hours (planner: replicas asked for, ready or not; oracle), their ratio, and attainment."""
    hours = {who: {role: sum(series[role]) / 60 for role in POOLS}
             for who, series in (("planner", trace.requested), ("oracle", trace.oracle))}
    for per_pool in hours.values():
        per_pool["total"] = per_pool["prefill"] + per_pool["decode"]
    attainable = sum(p / capacity.prefill_tokens_per_s <= targets.ttft_s
                     for p in (demand.prompt_tokens(m) for m in range(demand.minutes)))
    attainment = sum(trace.attained) / len(trace.attained)
    switch = int(demand.switch_hour * 60)
    phases = {f"{demand.prompt_tokens_before}-token prompts": trace.attained[:switch],
              f"{demand.prompt_tokens_after}-token prompts": trace.attained[switch:]}
    ratio = hours["planner"]["total"] / hours["oracle"]["total"]
    return {
        "replica_hours": hours,
        "replica_hours_ratio": ratio,
        "attainment": attainment,
        "attainment_by_phase": {name: sum(minutes) / len(minutes) for name, minutes in phases.items() if minutes},
        "minutes_where_a_prompt_fits_the_ttft": attainable,
        "peak_replicas": {who: {role: max(series[role]) for role in POOLS}
                          for who, series in (("planner", trace.requested), ("oracle", trace.oracle))},
        "target_met": attainment >= 0.9 and ratio <= 1.2,
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The simulation's flags."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--peak-rate", type=float, default=Demand.peak_rate, help="requests/s at the peak")
    parser.add_argument("--hours", type=int, default=Demand.hours)
    parser.add_argument("--seed", type=int, default=Demand.seed)
    parser.add_argument("--ttft-ms", type=float, default=2000.0, help="the SLO's TTFT")
    parser.add_argument("--tpot-ms", type=float, default=100.0, help="the SLO's TPOT")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=Capacity.prefill_tokens_per_s,
                        help="one prefill replica's prompt tokens/s")
    parser.add_argument("--decode-step-ms", type=float, default=Capacity.decode_base_s * 1e3,
                        help="fixed cost of one decode step")
    parser.add_argument("--decode-step-per-seq-ms", type=float, default=Capacity.decode_per_sequence_s * 1e3,
                        help="cost of one more sequence in a decode step")
    parser.add_argument("--kv-blocks-per-replica", type=int, default=Capacity.kv_blocks_per_replica)
    parser.add_argument("--planner-queue-drain-s", type=float, default=PlannerConfig.queue_drain_s,
                        help="seconds the planner drains queues within (the gateway's --planner-queue-drain-s)")
    parser.add_argument("--prefill-headroom-beta", type=float, default=PlannerConfig.prefill_headroom_beta,
                        help="prefill runs load + BETA x sqrt(load) replicas (the gateway's "
                             "--planner-prefill-headroom-beta)")
    parser.add_argument("--target-utilisation", type=float, default=PlannerConfig.target_utilisation,
                        help="the decode pool's share of its replicas' TPOT capacity")
    parser.add_argument("--scale-down-window", type=float, default=PlannerConfig.scale_down_window_s)
    parser.add_argument("--scale-cooldown", type=float, default=PlannerConfig.cooldown_s)
    parser.add_argument("--max-replicas", type=int, default=64, help="each pool's upper bound")
    parser.add_argument("--out", default=str(results_path(__name__, suffix="")),
                        help="results path without extension (.json)")
    parser.add_argument("--plot", default=str(results_path(__name__, suffix=".png")))
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    """Simulate the day, print the summary, write the JSON results and the plot."""
    args = parse_args(argv)
    demand = Demand(peak_rate=args.peak_rate, hours=args.hours, seed=args.seed)
    capacity = Capacity(prefill_tokens_per_s=args.prefill_tokens_per_s, decode_base_s=args.decode_step_ms / 1e3,
                        decode_per_sequence_s=args.decode_step_per_seq_ms / 1e3,
                        kv_blocks_per_replica=args.kv_blocks_per_replica)
    targets = Targets(ttft_s=args.ttft_ms / 1e3, tpot_s=args.tpot_ms / 1e3)
    bounds = PoolBounds(1, args.max_replicas)
    config = PlannerConfig(queue_drain_s=args.planner_queue_drain_s, tpot_s=targets.tpot_s,
                           prefill_headroom_beta=args.prefill_headroom_beta,
                           target_utilisation=args.target_utilisation, prefill=bounds, decode=bounds,
                           scale_down_window_s=args.scale_down_window, cooldown_s=args.scale_cooldown,
                           interval_s=MINUTE_S)
    trace = simulate(demand, capacity, targets, config)
    summary = summarize(trace, demand, capacity, targets)
    hours = summary["replica_hours"]
    print(f"replica-hours: planner {hours['planner']['total']:.1f} (prefill {hours['planner']['prefill']:.1f}, "
          f"decode {hours['planner']['decode']:.1f}), oracle {hours['oracle']['total']:.1f} "
          f"(prefill {hours['oracle']['prefill']:.1f}, decode {hours['oracle']['decode']:.1f}): "
          f"{summary['replica_hours_ratio']:.2f}x")
    print(f"SLO attainment: {summary['attainment']:.1%} of minutes (minutes where one prompt alone fits the "
          f"TTFT target: {summary['minutes_where_a_prompt_fits_the_ttft']} of {demand.minutes}; "
          + ", ".join(f"{share:.1%} with {name}" for name, share in summary["attainment_by_phase"].items())
          + "); "
          f"target (>= 90% at <= 1.2x) {'met' if summary['target_met'] else 'NOT met'}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as file:
        json.dump({
            "command": command_line(__name__, argv),
            "demand": asdict(demand), "capacity": asdict(capacity), "slo": asdict(targets),
            "planner": {"queue_drain_s": config.queue_drain_s, "tpot_s": config.tpot_s,
                        "prefill_headroom_beta": config.prefill_headroom_beta,
                        "target_utilisation": config.target_utilisation,
                        "kv_target_utilisation": config.kv_target_utilisation,
                        "scale_down_window_s": config.scale_down_window_s, "cooldown_s": config.cooldown_s,
                        "interval_s": config.interval_s, "ready_delay_s": READY_DELAY_S},
            "summary": summary, "minutes": asdict(trace),
        }, file)
        file.write("\n")
    from bench.planner.plot import plot_day  # matplotlib only here: the simulation runs without it

    plot_day(trace, summary, args.plot)
    print(f"wrote {args.out}.json and {args.plot}", file=sys.stderr)
    return 0

