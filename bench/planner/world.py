"""The planner simulation's world, pure (no planner, no I/O): the day's demand, per-replica capacity,
the prefill pool's queue, the decode pool's steady state, the per-minute SLO rule and the oracle.
The planner_sim suite (bench/suites/planner_sim.py) drives it with the planner's rules; its
docstring states the model in full.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

MINUTE_S = 60.0
ATTAINMENT_FRACTION = 0.9  # a minute attains its SLO when this share of its requests meet both targets


@dataclass(frozen=True)
class Capacity:
    """What one replica of each pool can do (defaults: SmolLM2-135M on one core of this machine,
    weights held at fp16 for decode, by the engine_throughput suite; docs/benchmarks.md, planner_sim)."""

    prefill_tokens_per_s: float = 280.0  # measured on 1,024-token prompts (340 on 256-token ones)
    decode_base_s: float = 0.024  # decode step time = base + per_sequence x batch, fitted to
    decode_per_sequence_s: float = 0.0056  # 31.1 / 43.4 / 70.1 ms at batch 1 / 4 / 8
    kv_blocks_per_replica: int = 728  # 512 MiB of fp32 KV, 16-token blocks of 45 KiB per token
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_base_s", "kv_blocks_per_replica", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.decode_per_sequence_s < 0:
            raise ValueError("decode_per_sequence_s: must be >= 0")

    def decode_step_s(self, batch: float) -> float:
        """Seconds of one decode step with `batch` sequences on a replica."""
        return self.decode_base_s + self.decode_per_sequence_s * batch


@dataclass(frozen=True)
class Targets:
    """The SLO a request must meet."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLO targets must be > 0")


@dataclass(frozen=True)
class Demand:
    """A day of traffic: a sinusoidal request rate with Poisson noise and a prompt mix that changes once."""

    peak_rate: float = 3.0  # requests/s at the peak
    low_fraction: float = 0.1  # the trough's rate as a share of the peak's
    peak_hour: float = 14.0
    hours: int = 24
    switch_hour: float = 12.0
    prompt_tokens_before: int = 256
    prompt_tokens_after: int = 1024
    output_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.peak_rate <= 0 or not 0 <= self.low_fraction <= 1 or self.hours <= 0:
            raise ValueError("demand: need peak_rate > 0, 0 <= low_fraction <= 1 and hours > 0")
        if min(self.prompt_tokens_before, self.prompt_tokens_after) <= 0 or self.output_tokens < 2:
            raise ValueError("demand: prompts need >= 1 token and outputs >= 2")

    @property
    def minutes(self) -> int:
        return self.hours * 60

    def rate(self, minute: int) -> float:
        """Expected requests/s in the middle of `minute`: the peak at `peak_hour`, the trough 12 hours away."""
        hour = (minute + 0.5) / 60
        wave = (1 + math.cos(2 * math.pi * (hour - self.peak_hour) / 24)) / 2
        return self.peak_rate * (self.low_fraction + (1 - self.low_fraction) * wave)

    def prompt_tokens(self, minute: int) -> int:
        """Prompt length of the requests arriving in `minute`."""
        return self.prompt_tokens_before if minute < self.switch_hour * 60 else self.prompt_tokens_after

    def arrivals(self) -> list[list[Request]]:
        """Each minute's requests, in arrival order; the same for the same seed."""
        rng = np.random.default_rng(self.seed)
        minutes = []
        for minute in range(self.minutes):
            count = int(rng.poisson(self.rate(minute) * MINUTE_S))
            times = np.sort(rng.uniform(minute * MINUTE_S, (minute + 1) * MINUTE_S, count))
            minutes.append([Request(float(t), self.prompt_tokens(minute), minute) for t in times])
        return minutes


@dataclass
class Request:
    """One simulated request and what it experienced (None until known)."""

    arrival_s: float
    prompt_tokens: int
    minute: int
    prefilled_s: float | None = field(default=None, compare=False)
    tpot_s: float | None = field(default=None, compare=False)

    @property
    def ttft_s(self) -> float:
        return math.inf if self.prefilled_s is None else self.prefilled_s - self.arrival_s

    def meets(self, targets: Targets) -> bool:
        return self.ttft_s <= targets.ttft_s and self.tpot_s is not None and self.tpot_s <= targets.tpot_s


def serve_fifo(free_at: list[float], waiting: deque[Request], speed: float, until_s: float) -> list[Request]:
    """Start waiting requests in arrival order on the replica free soonest (`free_at` is a heap of
    the times each replica finishes its current prompt), each computed alone at `speed` tokens/s,
    until the next one could not start before `until_s`; the requests prefilled, in start order."""
    served = []
    while waiting and free_at:
        request = waiting[0]
        start = max(request.arrival_s, free_at[0])
        if start >= until_s:
            break
        waiting.popleft()
        request.prefilled_s = start + request.prompt_tokens / speed
        heapq.heapreplace(free_at, request.prefilled_s)
        served.append(request)
    return served


class PrefillPool:
    """The prefill pool's replicas and the queue in front of them; the queue carries over minutes."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.waiting: deque[Request] = deque()
        self._free_at: list[float] = []

    def resize(self, replicas: int, now_s: float) -> None:
        """Run `replicas` ready replicas from `now_s`: new ones start idle; removed ones are those free
        soonest (a replica computing a prompt finishes it before it goes, as a drained pod does)."""
        while len(self._free_at) < replicas:
            heapq.heappush(self._free_at, now_s)
        while len(self._free_at) > replicas:
            heapq.heappop(self._free_at)

    def run(self, arrivals: Iterable[Request], until_s: float) -> list[Request]:
        """Queue `arrivals` and prefill what the replicas can start before `until_s`."""
        self.waiting.extend(arrivals)
        return serve_fifo(self._free_at, self.waiting, self.speed, until_s)

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(request.prompt_tokens for request in self.waiting)


def decode_steady_state(rate_per_s: float, replicas: int, output_tokens: int,
                        capacity: Capacity) -> tuple[float, float]:
    """Sequences decoding and TPOT when `rate_per_s` requests a second reach `replicas` replicas.

    Each request decodes `output_tokens - 1` steps (prefill made the first token), spread evenly, so
    by Little's law sequences S = rate x steps x step(S / replicas); solved for S. Where the pool
    cannot keep up (no fixed point) both are infinite."""
    if rate_per_s <= 0:
        return 0.0, capacity.decode_step_s(0)
    steps = output_tokens - 1
    slack = 1 - rate_per_s * steps * capacity.decode_per_sequence_s / replicas if replicas > 0 else 0.0
    if slack <= 0:
        return math.inf, math.inf
    sequences = rate_per_s * steps * capacity.decode_base_s / slack
    return sequences, capacity.decode_step_s(sequences / replicas)


def minute_attains(requests: Sequence[Request], targets: Targets) -> bool:
    """The per-minute SLO rule: at least ATTAINMENT_FRACTION of the minute's requests meet both targets."""
    return not requests or sum(r.meets(targets) for r in requests) >= ATTAINMENT_FRACTION * len(requests)


def oracle_prefill(requests: Sequence[Request], start_s: float, capacity: Capacity, targets: Targets) -> int:
    """The fewest prefill replicas that, idle at `start_s` with no earlier queue, give at least
    ATTAINMENT_FRACTION of these requests their TTFT and compute the minute's prompt tokens within
    the minute. Where no count meets the TTFT (a prompt alone takes longer), the throughput bound."""
    speed = capacity.prefill_tokens_per_s
    throughput = max(1, math.ceil(sum(r.prompt_tokens for r in requests) / (speed * MINUTE_S)))
    for replicas in range(throughput, max(throughput, len(requests)) + 1):
        trial = [Request(r.arrival_s, r.prompt_tokens, r.minute) for r in requests]
        serve_fifo([start_s] * replicas, deque(trial), speed, math.inf)
        if sum(r.ttft_s <= targets.ttft_s for r in trial) >= ATTAINMENT_FRACTION * len(trial):
            return replicas
    return throughput


def oracle_decode(rate_per_s: float, output_tokens: int, capacity: Capacity, targets: Targets) -> int:
    """The fewest decode replicas (1 at least) whose steady-state TPOT at `rate_per_s` meets the
    target; ValueError when a step's fixed cost alone exceeds it (no count would do)."""
    if capacity.decode_base_s >= targets.tpot_s:
        raise ValueError(f"a decode step takes at least {capacity.decode_base_s:.3f} s, not under the TPOT target")
    replicas = 1
    while decode_steady_state(rate_per_s, replicas, output_tokens, capacity)[1] > targets.tpot_s:
        replicas += 1
    return replicas
