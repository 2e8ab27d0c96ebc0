"""How many drafts each request takes this step: as many as pay for their verification on this CPU.

A step that verifies k drafts of a request computes k more rows, and what a row costs depends on
the CPU (engine.speculative.calibration times it at start-up): with AMX a step of a few rows costs
little more than a step of one; with AVX2 every row costs most of a step, so a verification that
keeps one token in four loses to not drafting. The j-th draft of a request yields a token when it
and every draft before it are accepted, with probability rate^j, where rate is the request's
acceptance estimate: decayed counts of its accepted drafts and of its rejections (a rejection ends
a verification), seeded with the engine's acceptance so far so that a new request does not start
cold. Across the step's requests the gate takes drafts best odds first and keeps the number that
gives the most expected tokens per second of step: none when no number beats not drafting, so a
speculating engine is never slower than one without (as far as its costs and rates are right).

A request that drafts nothing still learns its acceptance (it may enter a copied span): from a
cheap proposer (n-gram) the drafter takes shadow drafts it never verifies and scores them against
the tokens that follow; with any proposer it probes with one draft after some silent steps,
spending at most PROBE_SHARE of its time on probes.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.request import Request
from engine.speculative.stats import SpecDecodeStats

# Weight of the past in a request's counts at each verification: about the last three verifications count.
DECAY = 0.7
# The engine's acceptance seeds a request's estimate as this many observations: one shadow that
# matched all its 8 drafts must not bet 9-row verifications on a chat (measured through the mesh
# on the AMD EPYC at 2: 0.86x on chat prompts).
PRIOR_WEIGHT = 8.0
# Drafts must raise the expected tokens per second by this share: step times and acceptance are
# estimates, and a tie is better spent without drafting.
MARGIN = 0.05
# Share of the way a verification's cost in steps of one row moves toward each one served, and the
# recent one-row step toward each plain one served: about the last four count.
LEARN = 0.25
# At most this share of a silent request's time goes to probes.
PROBE_SHARE = 0.02


@dataclass(frozen=True)
class CostCurve:
    """Seconds of a step by the rows it computes (or its cost in steps of one row), measured at
    `rows` (ascending); linear between the measured counts and past the last two (in proportion to
    the rows from a single count)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds) or self.rows[0] < 1:
            raise ValueError(f"a cost curve needs one time for each of one or more row counts: {self}")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:], strict=False)) or min(self.seconds) <= 0:
            raise ValueError(f"a cost curve needs ascending row counts and positive times: {self}")

    def at(self, rows: int) -> float:
        """Seconds of a step of `rows` rows."""
        if len(self.rows) == 1:
            return self.seconds[0] * rows / self.rows[0]
        index = min(max(1, bisect.bisect_left(self.rows, rows)), len(self.rows) - 1)
        r0, r1, s0, s1 = self.rows[index - 1], self.rows[index], self.seconds[index - 1], self.seconds[index]
        return max(s0 + (s1 - s0) * (rows - r0) / (r1 - r0), min(self.seconds))

    def faster(self, rows: int, seconds: float) -> CostCurve:
        """This curve with a step of `rows` rows timed at `seconds`: kept where it is faster than the
        time measured at that count (another process only ever slows a step down)."""
        if rows not in self.rows or seconds >= self.seconds[self.rows.index(rows)]:
            return self
        index = self.rows.index(rows)
        return CostCurve(self.rows, (*self.seconds[:index], seconds, *self.seconds[index + 1:]))

    def learned(self, rows: int, value: float) -> CostCurve:
        """This curve moved a LEARN share toward `value` at `rows`: the measured counts on either side
        of it (or the nearest, outside them) by their weight in the interpolation at `rows`."""
        if len(self.rows) == 1 or rows <= self.rows[0] or rows >= self.rows[-1]:
            weights = {0 if rows <= self.rows[0] else len(self.rows) - 1: 1.0}
        else:
            above = next(i for i, r in enumerate(self.rows) if r >= rows)
            share = (rows - self.rows[above - 1]) / (self.rows[above] - self.rows[above - 1])
            weights = {above - 1: 1 - share, above: share}
        factor = value / self.at(rows) - 1
        return CostCurve(self.rows, tuple(s * (1 + LEARN * weights.get(i, 0.0) * factor)
                                          for i, s in enumerate(self.seconds)))

    def describe(self) -> str:
        return ", ".join(f"{r}: {1e3 * s:.1f} ms" for r, s in zip(self.rows, self.seconds, strict=True))


@dataclass(frozen=True)
class StepCosts:
    """What steps cost on this engine: `decode` by its sequences, one row each (a path of its own on
    some CPUs: engine.model.decode_stack), and `verify_steps` a lone request's verification by its
    rows, in steps of one row; `one_row_s`, the recent one-row steps served, is what verifications
    served are weighed against.

    Workers start together, so a start-up timing may find the CPU busy, and the steps served
    correct it (`observed`): the decode curve keeps the fastest time seen at its row counts. A
    verification's ratio moves toward those served (LEARN), up as well as down: the start-up
    timings keep each count's fastest of a few back-to-back steps, and verifications served between
    one-row steps cost more (a 9-row one 4.5 steps against 3.9 timed at start-up, AMD EPYC), which
    made bets that lost on chat look cheap. A step of r rows never costs more than r steps of one
    (it streams the weights once)."""

    decode: CostCurve
    verify_steps: CostCurve
    one_row_s: float

    def decode_s(self, sequences: int) -> float:
        """Seconds of a decode step of `sequences` sequences, one row each."""
        return min(self.decode.at(sequences), sequences * self.decode.at(1))

    def verify_s(self, rows: int) -> float:
        """Seconds of a step of `rows` rows, some of them drafts."""
        return min(self.verify_steps.at(rows), rows) * self.decode.at(1)

    def added_s(self, drafts: int) -> float:
        """What `drafts` drafts add to a step of one sequence."""
        return self.verify_s(1 + drafts) - self.decode_s(1) if drafts else 0.0

    def step_s(self, sequences: int, drafts: Sequence[int]) -> float:
        """Seconds of a step of `sequences` decoding sequences, some verifying `drafts` drafts each:
        at least the plain batch plus what each one's drafts add to a step of one sequence (the
        verification curve was timed on one; in a batch the rows share the weights' streaming, but
        not the attention or the path a step with drafts takes)."""
        if not any(drafts):
            return self.decode_s(sequences)
        return max(self.verify_s(sequences + sum(drafts)),
                   self.decode_s(sequences) + sum(self.added_s(n) for n in drafts))

    def observed(self, sequences: int, rows: int, seconds: float) -> StepCosts:
        """These costs with a decode step of `sequences` sequences and `rows` rows (more with drafts)
        timed at `seconds` (see the class)."""
        if rows == sequences:
            recent = self.one_row_s + LEARN * (seconds - self.one_row_s) if rows == 1 else self.one_row_s
            return replace(self, decode=self.decode.faster(rows, seconds), one_row_s=recent)
        if sequences == 1:
            return replace(self, verify_steps=self.verify_steps.learned(rows, min(seconds / self.one_row_s, rows)))
        return self

    def describe(self) -> str:
        ratios = zip(self.verify_steps.rows, self.verify_steps.seconds, strict=True)
        return (f"decode batch of {self.decode.describe()}; verification of "
                f"{', '.join(f'{r}: {s:.2f}' for r, s in ratios)} steps of one row")


def record_verification(request: Request, num_drafts: int, accepted: int) -> None:
    """Fold one verification of `num_drafts` drafts, `accepted` of them kept, into the request's counts."""
    request.drafts_accepted = DECAY * request.drafts_accepted + accepted
    request.drafts_rejected = DECAY * request.drafts_rejected + (1 if accepted < num_drafts else 0)
    request.silent_steps = 0


def follow_shadow(request: Request) -> None:
    """Score the request's shadow drafts (proposed, never verified) against the tokens that came
    after them, once a token differs or all matched, as a verification of them would have counted."""
    shadow = request.shadow_token_ids
    came = request.token_ids[request.shadow_from : request.shadow_from + len(shadow)]
    differs = next((i for i, (draft, token) in enumerate(zip(shadow, came, strict=False)) if draft != token), None)
    if not shadow or (differs is None and len(came) < len(shadow)):
        return
    record_verification(request, len(shadow), len(shadow) if differs is None else differs)
    request.shadow_token_ids = []


def acceptance_rate(request: Request, prior: float) -> float:
    """The chance that the request's next draft is accepted, given the one before it was."""
    return (request.drafts_accepted + PRIOR_WEIGHT * prior) / (
        request.drafts_accepted + request.drafts_rejected + PRIOR_WEIGHT)


def engine_rate(stats: SpecDecodeStats) -> float:
    """The share of drafted tokens the engine kept so far (a half before any draft)."""
    return (stats.num_accepted_tokens + 1) / (stats.num_draft_tokens + 2)


def draft_counts(rates: Sequence[float], caps: Sequence[int], probes: Sequence[bool], other_rows: int,
                 costs: StepCosts) -> list[int]:
    """Drafts per request (at most its cap) maximising the step's expected tokens per second, each
    request's j-th draft yielding a token with probability rate^j; `probes` take one draft whatever
    it costs; `other_rows`: rows of the step's other requests, one token each."""
    counts = [min(1, cap) if probe else 0 for cap, probe in zip(caps, probes, strict=True)]
    sequences = len(caps) + other_rows
    # Each count's cost looked up once: this runs before every step, a tenth of a millisecond
    # that a batch-1 step of 10 ms paid again and again through the curves' interpolation.
    added_s = [costs.added_s(n) for n in range(max(caps, default=0) + 1)]
    verify_s = [costs.verify_s(r) for r in range(sequences + sum(caps) + 1)]
    tokens = sequences + sum(rate for rate, n in zip(rates, counts, strict=True) if n)
    rows, added = sequences + sum(counts), sum(added_s[n] for n in counts)
    plain = costs.decode_s(sequences)

    def step_s() -> float:  # StepCosts.step_s, kept up to date draft by draft
        return max(verify_s[rows], plain + added) if rows > sequences else plain

    best, best_taken, taken, planned = tokens / step_s() * (1 + MARGIN), 0, [], list(counts)
    odds = [(-rate ** (n + 1), i) for i, (rate, n, cap) in enumerate(zip(rates, counts, caps, strict=True))
            if n < cap and rate > 0]
    heapq.heapify(odds)
    while odds:
        negative_gain, i = heapq.heappop(odds)
        taken.append(i)
        added += added_s[planned[i] + 1] - added_s[planned[i]]
        planned[i] += 1
        rows += 1
        tokens -= negative_gain
        if tokens / step_s() > best:
            best, best_taken = tokens / step_s(), len(taken)
        if planned[i] < caps[i]:
            heapq.heappush(odds, (negative_gain * rates[i], i))
    for i in taken[:best_taken]:
        counts[i] += 1
    return counts


class DraftGate:
    """Draft counts for the requests of a step on the costs measured for this engine (see the module)."""

    def __init__(self, costs: StepCosts, stats: SpecDecodeStats) -> None:
        self.costs = costs
        self.stats = stats
        # Silent steps between probes: what a probe adds to a step of one row, over PROBE_SHARE of that step.
        one = costs.decode_s(1)
        self.probe_interval = max(1, math.ceil((costs.verify_s(2) - one) / (PROBE_SHARE * one)))

    def observe(self, sequences: int, rows: int, seconds: float) -> None:
        """A decode step of `sequences` sequences and `rows` rows took `seconds`: the start-up timing
        ran beside whatever else started then, so the steps served refine it."""
        self.costs = self.costs.observed(sequences, rows, seconds)

    def counts(self, requests: Sequence[Request], caps: Sequence[int], other_rows: int) -> list[int]:
        """How many drafts each of `requests` (decoding, with room for `caps` drafts) takes; a
        request given none moves toward its next probe."""
        prior = engine_rate(self.stats)
        rates = [acceptance_rate(request, prior) for request in requests]
        probes = [request.silent_steps >= self.probe_interval for request in requests]
        counts = draft_counts(rates, caps, probes, other_rows, self.costs)
        for request, count in zip(requests, counts, strict=True):
            if count == 0:
                request.silent_steps += 1
        return counts
