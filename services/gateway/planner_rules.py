"""How many replicas each pool needs: pure rules over what the workers measure (no I/O, no torch).

Prefill: the pool must compute prompt tokens as fast as they arrive, with headroom for the
bursts of random (Poisson) arrivals, and also drain what is already queued within
`queue_drain_s`. The headroom follows square-root staffing: with an offered load of `load`
replicas' worth of work, the queue a burst leaves grows with sqrt(load), so a pool runs
`load + beta x sqrt(load)` replicas (`prefill_headroom_beta`, 0.6 by default). The share of
headroom shrinks as the pool grows, where a fixed utilisation gives every pool the same share: too
little for a small pool's bursts, more replicas than a large one needs (`python -m bench planner_sim`,
docs/benchmarks.md). The drain time is about how long a new replica takes to be ready (a pod
scheduled, its model loaded: minutes): replicas asked for to drain a queue faster than that arrive
after it has gone, and are then held through the scale-down window. For the same reason a queued
prompt, computed by one replica, never asks for more than one replica:

    load = arrival tokens/s / measured tokens/s per replica
    replicas = ceil(load + beta x sqrt(load)
                    + min(queued tokens / queue drain time / measured tokens/s, queued prompts))

Decode: the pool must decode its sequences within the TPOT target and keep the KV cache below
`kv_target_utilisation`. With the workers' fitted step model (a fixed cost per step plus a cost
per sequence), a replica at the target runs the batch at which the model reaches it, and the pool
must produce its current token rate: every sequence gets a token per step, so sequences / measured
step time. (Sizing by the sequences themselves undercounts an over-provisioned pool: its steps are
fast, so by Little's law it holds few sequences, and it would shrink to one replica and overflow.)
Before a model is fitted, a replica's capacity is extrapolated from the measured TPOT at the
current batch, assuming step time grows in proportion to the batch (which errs towards more
replicas, since each step also has a fixed cost):

    batch at target = max((TPOT target - fixed cost) / cost per sequence, 1)
    replicas for TPOT = (sequences / measured TPOT) / (batch at target / its step time)
                     or sequences / (batch x TPOT target / measured TPOT)
    replicas = max(ceil(replicas for TPOT / utilisation),
                   ceil(used KV blocks / (blocks per replica x KV utilisation)))

Colocated (the flexible shape: every worker computes prompts and decodes): neither a prompt queue
nor KV use says such a worker is full, so the pool is sized on the signal its HPA reads
(services.gateway.pool_load): summed over its workers, the share of the TTFT or TPOT objective (the
larger) the recent typical request would use on each, as the router predicts it. A replica is
kept at `slo_use_target` of that, as the HPA's per-pod target keeps it:

    replicas = ceil(summed use / slo_use_target)

Counts are clamped to each pool's bounds. `ScaleDecision` then damps them: a higher count is
taken at once, a lower one only once it has been the highest recommendation for a whole
stabilisation window, and no change follows another within the cooldown.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolBounds:
    """The fewest and most replicas a pool may have."""

    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"replicas: need 0 <= min <= max and max >= 1, "
                             f"got {self.min_replicas}:{self.max_replicas}")

    def clamp(self, replicas: int) -> int:
        """`replicas` within the bounds."""
        return min(max(replicas, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class PlannerConfig:
    """SLO targets, headroom and damping of the planner."""

    queue_drain_s: float = 120.0
    tpot_s: float = 0.1
    prefill_headroom_beta: float = 0.6  # prefill runs load + beta x sqrt(load) replicas
    target_utilisation: float = 0.8  # decode's, of its replicas' TPOT capacity
    kv_target_utilisation: float = 0.8
    slo_use_target: float = 0.8  # colocated's, of each replica's objectives (the flexible overlay's HPA target)
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    colocated: PoolBounds = field(default_factory=PoolBounds)
    scale_down_window_s: float = 300.0
    cooldown_s: float = 60.0
    interval_s: float = 15.0

    def __post_init__(self) -> None:
        for name in ("queue_drain_s", "tpot_s", "interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        for name in ("target_utilisation", "kv_target_utilisation", "slo_use_target"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}: must be in (0, 1]")
        for name in ("prefill_headroom_beta", "scale_down_window_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")


@dataclass(frozen=True)
class PrefillDemand:
    """What the prefill pool faces and how fast one of its replicas is."""

    arrival_tokens_per_s: float
    queued_prompt_tokens: int
    tokens_per_s_per_replica: float  # measured prefill speed; 0 until measured
    queued_requests: int = 0  # prompts waiting, over the pool; 0 when unknown (no cap)


@dataclass(frozen=True)
class DecodeDemand:
    """What the decode pool holds and what one of its replicas can hold."""

    sequences: int  # running, waiting and reserved, over the pool
    used_kv_blocks: int  # held by requests, over the pool
    kv_blocks_per_replica: int  # 0 until a replica reported
    batch_per_replica: float  # running sequences per replica when the TPOT was measured
    tpot_s: float  # measured time per output token at that batch; 0 until measured
    step_base_s: float = 0.0  # the step model's fixed cost of a decode step; 0 until fitted
    step_per_sequence_s: float = 0.0  # its cost per sequence, attention to the sequence's context included

    def replicas_for_tpot(self, tpot_target_s: float) -> float | None:
        """Replicas (fractional, at full use) that keep the pool's decode within `tpot_target_s`;
        None until measured.

        With a fitted step model the pool is sized by its token rate, sequences / step time: how
        many sequences are in flight depends on how fast the pool steps (Little's law), so an
        over-provisioned pool holds few and would look like it needed one replica."""
        if self.step_per_sequence_s > 0 and self.tpot_s > 0:
            batch = max((tpot_target_s - self.step_base_s) / self.step_per_sequence_s, 1.0)
            step_s = self.step_base_s + self.step_per_sequence_s * batch
            return (self.sequences / self.tpot_s) / (batch / step_s)
        if self.tpot_s > 0:
            return self.sequences / (max(self.batch_per_replica, 1.0) * tpot_target_s / self.tpot_s)
        return None


def prefill_replicas(demand: PrefillDemand, config: PlannerConfig) -> int | None:
    """Prefill replicas needed, within bounds; None while no replica has measured its speed."""
    if demand.tokens_per_s_per_replica <= 0:
        return None
    load = demand.arrival_tokens_per_s / demand.tokens_per_s_per_replica
    queue = demand.queued_prompt_tokens / config.queue_drain_s / demand.tokens_per_s_per_replica
    if demand.queued_requests:
        queue = min(queue, demand.queued_requests)
    return config.prefill.clamp(math.ceil(load + config.prefill_headroom_beta * math.sqrt(load) + queue))


def decode_replicas(demand: DecodeDemand, config: PlannerConfig) -> int | None:
    """Decode replicas needed, within bounds; None while no replica has reported its KV size."""
    if demand.kv_blocks_per_replica <= 0:
        return None
    kv = math.ceil(demand.used_kv_blocks / (demand.kv_blocks_per_replica * config.kv_target_utilisation))
    sequences = 0
    if replicas := demand.replicas_for_tpot(config.tpot_s):
        sequences = math.ceil(replicas / config.target_utilisation)
    return config.decode.clamp(max(kv, sequences))


def colocated_replicas(slo_use: float, config: PlannerConfig) -> int:
    """Colocated replicas needed for a pool whose workers' summed use of the objectives is
    `slo_use`, within bounds."""
    return config.colocated.clamp(math.ceil(slo_use / config.slo_use_target))


class ScaleDecision:
    """One pool's replica count over time: up at once, down after a stabilisation window, and
    never twice within the cooldown."""

    def __init__(self, window_s: float, cooldown_s: float) -> None:
        self._window_s = window_s
        self._cooldown_s = cooldown_s
        self._history: deque[tuple[float, int]] = deque()
        self._since: float | None = None
        self._changed_at: float | None = None

    def decide(self, now: float, recommended: int, current: int) -> int:
        """The count to run now (`now` in seconds, monotonic) given this step's recommendation
        and the count running."""
        self._since = now if self._since is None else self._since
        self._history.append((now, recommended))
        while self._history[0][0] < now - self._window_s:
            self._history.popleft()
        if recommended > current:
            target = recommended
        elif now - self._since < self._window_s:
            target = current  # a window not yet observed in full cannot justify a scale-down
        else:
            target = min(current, max(count for _, count in self._history))
        if target == current:
            return current
        if self._changed_at is not None and now - self._changed_at < self._cooldown_s:
            return current
        self._changed_at = now
        return target
