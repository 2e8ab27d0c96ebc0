"""The planner: each interval, the replicas each pool needs for the demand the gateway sees.

The fixed pools (prefill, decode) are sized from their workers' load reports and the prompt tokens
routed to them; a colocated pool (the flexible shape) from what the recent typical request would
use of the objectives on each of its workers (the gateway's `tandem:pool_slo_use`).

A pool is one model version's workers of one role: with a model repository each version (a canary,
say) runs on its own Deployments, so it is sized from its own workers' reports and the prompt
tokens routed to it; a gateway of one model has one group of workers.

`recommend` mode only keeps the numbers (`recommended`, exported as
`tandem:planner_recommended_replicas`); `apply` mode also sets them on the pools' Deployments
through the `scale` subresource, from one gateway replica at a time (the holder of a Lease). The
rules are in `planner_rules`; this module turns the registry's load reports into their inputs.

The prompt-token arrival rate is what this gateway routed. With several gateway replicas each sees
its share, so the leader underestimates the rate; the queued-tokens term, which comes from the
workers and so covers all traffic, makes up for it once queues grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from statistics import fmean
from typing import Literal

from services.gateway.kube import DeploymentScale, LeaseElection, Pool
from services.gateway.planner_rules import (
    DecodeDemand,
    PlannerConfig,
    PrefillDemand,
    ScaleDecision,
    colocated_replicas,
    decode_replicas,
    prefill_replicas,
)
from services.gateway.registry import WorkerRegistry
from services.gateway.router import Role
from services.gateway.workers import RemoteWorker

log = logging.getLogger(__name__)

Mode = Literal["off", "recommend", "apply"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")


class Planner:
    """Recommended replicas per pool (model version and role), from the registry's load reports;
    set on the cluster when given a `DeploymentScale` and a `LeaseElection` (apply mode)."""

    def __init__(self, registry: WorkerRegistry, config: PlannerConfig,
                 scale: DeploymentScale | None = None, election: LeaseElection | None = None,
                 clock: Callable[[], float] = time.monotonic, per_version: bool = False) -> None:
        """`per_version`: the gateway serves a model repository, so the workers are grouped by the
        version their reports name; otherwise they are one group, version None."""
        if (scale is None) != (election is None):
            raise ValueError("apply mode needs both the Deployments' scale and a leader election")
        self.config = config
        self.recommended: dict[Pool, int | None] = {}
        self.leading = False
        self._registry = registry
        self._scale = scale
        self._election = election
        self._clock = clock
        self._per_version = per_version
        self._decisions: dict[Pool, ScaleDecision] = {}
        self._unscaled: set[Pool] = set()  # pools without a Deployment, logged once each
        self._sent: dict[RemoteWorker, int] = {}
        self._sampled_at: float | None = None
        self._task: asyncio.Task | None = None

    def recommend(self) -> dict[Pool, int | None]:
        """Sample the registry now; the replicas each version's pools need (None until measured)."""
        now = self._clock()
        groups: dict[str | None, list[RemoteWorker]] = defaultdict(list)
        for worker in self._registry.workers:
            # A worker that never reported names no version yet (and is not routed to).
            if worker.role in ROLES and (not self._per_version or worker.version_key is not None):
                groups[worker.version_key if self._per_version else None].append(worker)
        arrivals = self._arrival_rates(now, groups)
        slo_use: dict[str | None, float] = defaultdict(float)
        for (version, role), use in self._registry.pool_slo_use().items():
            if role == "colocated":
                slo_use[version if self._per_version else None] += use
        recommended: dict[Pool, int | None] = {}
        for version, workers in groups.items():
            prefill = [w.report for w in workers if w.role == "prefill" and w.routable]
            decode = [w.report for w in workers if w.role == "decode" and w.routable]
            recommended[version, "prefill"] = (
                prefill_replicas(prefill_demand(arrivals[version], prefill), self.config) if prefill else None)
            recommended[version, "decode"] = decode_replicas(decode_demand(decode), self.config) if decode else None
            if any(w.role == "colocated" for w in workers):
                # No use before a request was placed (no typical request yet) or with no routable worker.
                use = slo_use.get(version)
                recommended[version, "colocated"] = None if use is None else colocated_replicas(use, self.config)
        self.recommended = recommended
        return recommended

    def apply(self) -> None:
        """Lead (or not) and set each pool's replicas as decided; blocking Kubernetes calls."""
        assert self._scale is not None and self._election is not None
        self.leading = self._election.try_lead()
        if not self.leading:
            return
        now = self._clock()
        for pool, recommended in self.recommended.items():
            if recommended is None:
                continue
            if not self._scale.holds(pool):
                if pool not in self._unscaled:
                    self._unscaled.add(pool)
                    log.warning("planner: no Deployment named for the %s pool: recommended only", _name(pool))
                continue
            current = self._scale.replicas(pool)
            decision = self._decisions.setdefault(
                pool, ScaleDecision(self.config.scale_down_window_s, self.config.cooldown_s))
            target = decision.decide(now, recommended, current)
            if target != current:
                log.info("planner: %s pool %d -> %d replicas (recommended %d)", _name(pool), current, target,
                         recommended)
                self._scale.set_replicas(pool, target)

    def start(self) -> None:
        """Plan every interval on the running event loop until `stop`."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop planning."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            self.recommend()
            if self._scale is not None:
                try:
                    await asyncio.to_thread(self.apply)
                except Exception as error:  # the API may be briefly unreachable: plan again next interval
                    log.warning("planner: could not apply %s: %s", self.recommended, error)

    def _arrival_rates(self, now: float, groups: dict[str | None, list[RemoteWorker]]) -> dict[str | None, float]:
        """Prompt tokens per second this gateway sent each version's prefill pool since the last sample."""
        elapsed = None if self._sampled_at is None else now - self._sampled_at
        sent: dict[RemoteWorker, int] = {}
        rates: dict[str | None, float] = {}
        for version, workers in groups.items():
            routed = 0
            for worker in workers:
                if worker.role == "prefill":
                    sent[worker] = worker.prompt_tokens_sent
                    routed += worker.prompt_tokens_sent - self._sent.get(worker, 0)
            rates[version] = routed / elapsed if elapsed else 0.0
        self._sent, self._sampled_at = sent, now
        return rates


def _name(pool: Pool) -> str:
    version, role = pool
    return f"{version} {role}" if version is not None else role


def prefill_demand(arrival_tokens_per_s: float, reports: Sequence) -> PrefillDemand:
    """The prefill pool's demand from its workers' LoadReports and the routed arrival rate."""
    speeds = [report.prefill_tokens_per_s for report in reports if report.prefill_tokens_per_s > 0]
    return PrefillDemand(
        arrival_tokens_per_s=arrival_tokens_per_s,
        queued_prompt_tokens=sum(report.queued_prompt_tokens for report in reports),
        queued_requests=sum(report.waiting_requests for report in reports),
        tokens_per_s_per_replica=fmean(speeds) if speeds else 0.0,
    )


def decode_demand(reports: Sequence) -> DecodeDemand:
    """The decode pool's demand from its workers' LoadReports. A sequence's step cost counts its
    attention over the pool's mean context per running sequence."""
    timed = [report for report in reports if report.tpot_s > 0]
    fitted = [report.step_model for report in reports if report.step_model.per_sequence_s > 0]
    running = sum(report.running_requests for report in reports)
    context = sum(report.context_tokens for report in reports) / running if running else 0.0
    return DecodeDemand(
        sequences=sum(r.running_requests + r.waiting_requests + r.reserved_requests for r in reports),
        used_kv_blocks=sum(report.used_kv_blocks for report in reports),
        kv_blocks_per_replica=round(fmean(report.total_kv_blocks for report in reports)),
        batch_per_replica=fmean(report.running_requests for report in timed) if timed else 0.0,
        tpot_s=fmean(report.tpot_s for report in timed) if timed else 0.0,
        step_base_s=fmean(model.base_s for model in fitted) if fitted else 0.0,
        step_per_sequence_s=fmean(model.per_sequence_s + model.per_context_token_s * context
                                  for model in fitted) if fitted else 0.0,
    )
