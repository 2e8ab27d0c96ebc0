"""Deployment advice: how many workers a workload needs, and how much of its prompt work to
disaggregate, predicted from a worker's measured step model (services.common.step_model).

The deployment is a pool of identical workers of which `decoding` decode every request and compute
the share 1 − f of the prompts themselves (aggregated placement), while `prefilling` workers compute
the share f for them (disaggregated placement): f = 0 is a colocated pool, f = 1 with both kinds
fixed prefill and decode pools. At a steady arrival rate λ the model is mean-value:

- A decoding worker's batch step takes base + (per_sequence + per_context_token x C) x (sequences in
  the batch), C the mean context a decoding sequence attends to. It holds λ O T / d sequences
  (Little's law; O output tokens, one a step of T seconds), so T = base + ρd T: T = base / (1 − ρd),
  ρd = (λ / d) O (b + c C).
- A prompt of p tokens needs S(p) = p x per_prompt_token + ceil(p / chunk) x base of a worker's time,
  and shares the worker with the rest of its work as processor sharing does: its TTFT is
  S(p) / (1 − ρ), ρ the worker's whole load (on a decoding worker its share ρl = (λ / d)(1 − f) P a of
  local prompts included, and each chunk's step carries the batch too).
- A prompt computed where sequences decode stretches each of them by S(P) over its O tokens; how
  many such prompts a sequence meets is Poisson, of mean (λ / d)(1 − f)(O T + S(P)). TPOT is T plus
  the 90th-percentile count of them times S(P) / O: disaggregating a share f of the prompts lowers it.

TTFT is judged at the trace's 90th-percentile prompt, TPOT at the 90th-percentile interference.

A configuration is feasible when every worker's ρ < 1 and both predictions meet the objectives;
the advice is the fewest workers with a feasible configuration at the rate, the one with the most
headroom among them (the lowest of the predictions' largest share of its objective). Mean-value
predictions ignore bursts, so the advice is a floor to check against measured goodput
(`python -m bench goodput`), which docs/benchmarks.md records beside it. Imports neither torch nor grpc.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.step_model import StepModel
from services.gateway.router import SloTargets

SHARE_STEPS = 20  # the disaggregated share f is tried in steps of 1/20


@dataclass(frozen=True)
class TraceShape:
    """What the model needs of a workload trace: its prompt lengths and mean output and context."""

    prompt_p90: float
    prompt_mean: float
    output_mean: float
    context_mean: float  # the mean context a decoding sequence attends to, over its output tokens

    @classmethod
    def of(cls, requests: Sequence[tuple[int, int]]) -> TraceShape:
        """From (prompt tokens, output tokens) pairs; ValueError for none."""
        if not requests:
            raise ValueError("the trace has no requests")
        prompts = sorted(p for p, _ in requests)
        outputs = sum(o for _, o in requests)
        context = sum(o * (p + o / 2) for p, o in requests) / max(1, outputs)
        return cls(prompts[min(len(prompts) - 1, math.ceil(0.9 * len(prompts)) - 1)], sum(prompts) / len(prompts),
                   outputs / len(requests), context)


@dataclass(frozen=True)
class Layout:
    """A pool's split and its predicted latencies at one rate."""

    workers: int
    prefilling: int  # workers that compute prompts for the others
    disaggregated_share: float  # f: the share of prompts computed on a prefilling worker
    ttft_s: float  # the worse of the two placements' at the 90th-percentile prompt
    tpot_s: float

    def headroom(self, objectives: SloTargets) -> float:
        """The larger of the predictions' shares of their objective (< 1: both met)."""
        return max(self.ttft_s / objectives.ttft_s, self.tpot_s / objectives.tpot_s)


def _poisson_p90(mean: float) -> int:
    """The 90th percentile of a Poisson count of mean `mean`."""
    count, term = 0, math.exp(-mean)
    total = term
    while total < 0.9:
        count += 1
        term *= mean / count
        total += term
    return count


def predict(model: StepModel, trace: TraceShape, rate: float, workers: int, prefilling: int, share: float,
            chunk_tokens: int) -> Layout | None:
    """The predicted latencies of one split at `rate` requests/s; None when a worker would be
    overloaded (ρ ≥ 1) or the split is not one (no decoding worker, or prompts sent to no prefilling one)."""
    decoding = workers - prefilling
    if decoding < 1 or (share > 0) != (prefilling > 0):
        return None
    a, per_batch = model.per_prompt_token_s, model.per_sequence_s + model.per_context_token_s * trace.context_mean
    per_worker = rate / decoding
    rho_decode = per_worker * trace.output_mean * per_batch
    rho_local = per_worker * (1 - share) * trace.prompt_mean * a
    if rho_decode + rho_local >= 1:
        return None
    step_s = model.base_s / (1 - rho_decode)  # a step of the batch alone
    batch = per_worker * trace.output_mean * step_s

    def prompt_s(tokens: float, step_base_s: float) -> float:
        return tokens * a + math.ceil(tokens / max(1, chunk_tokens)) * step_base_s

    ttft_s, tpot_s = 0.0, step_s
    if share < 1:  # some prompts computed where they decode, between the batch's steps
        local_s = prompt_s(trace.prompt_mean, 0.0)
        ttft_s = prompt_s(trace.prompt_p90, model.base_s + per_batch * batch) / (1 - rho_decode - rho_local)
        # Each prompt computed while a sequence decodes stretches its output by the prompt's time:
        # the 90th-percentile sequence meets the 90th-percentile count of them.
        overlapping = per_worker * (1 - share) * (trace.output_mean * step_s + local_s)
        tpot_s += _poisson_p90(overlapping) * local_s / max(1.0, trace.output_mean)
    if prefilling:
        rho_prefilling = rate * share / prefilling * prompt_s(trace.prompt_mean, model.base_s)
        if rho_prefilling >= 1:
            return None
        ttft_s = max(ttft_s, prompt_s(trace.prompt_p90, model.base_s) / (1 - rho_prefilling) + step_s)
    return Layout(workers, prefilling, share, ttft_s, tpot_s / max(1.0, model.tokens_per_decode_step))


def best_layout(model: StepModel, trace: TraceShape, rate: float, workers: int, objectives: SloTargets,
                chunk_tokens: int) -> Layout | None:
    """The split of `workers` with the most headroom at `rate` that meets the objectives; None if none does."""
    layouts = [predict(model, trace, rate, workers, 0, 0.0, chunk_tokens)]
    for prefilling in range(1, workers):
        layouts += [predict(model, trace, rate, workers, prefilling, step / SHARE_STEPS, chunk_tokens)
                    for step in range(1, SHARE_STEPS + 1)]
    feasible = [layout for layout in layouts if layout is not None and layout.headroom(objectives) <= 1]
    return min(feasible, key=lambda layout: layout.headroom(objectives), default=None)


def capacity(model: StepModel, trace: TraceShape, workers: int, objectives: SloTargets, chunk_tokens: int,
             ceiling: float = 1000.0) -> tuple[float, Layout | None]:
    """The highest rate (req/s, to 0.5%) at which some split of `workers` meets the objectives, and
    that split; (0, None) when none does even at a trickle."""
    low, high, found = 0.0, ceiling, None
    while high - low > 0.005 * max(high, 1e-3):
        middle = (low + high) / 2
        if (layout := best_layout(model, trace, middle, workers, objectives, chunk_tokens)) is not None:
            low, found = middle, layout
        else:
            high = middle
    return (low, found) if found is not None else (0.0, None)


def workers_needed(model: StepModel, trace: TraceShape, rate: float, objectives: SloTargets, chunk_tokens: int,
                   most: int = 64) -> Layout | None:
    """The smallest pool (at most `most` workers) with a split meeting the objectives at `rate`."""
    for workers in range(1, most + 1):
        if (layout := best_layout(model, trace, rate, workers, objectives, chunk_tokens)) is not None:
            return layout
    return None
