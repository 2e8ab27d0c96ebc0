"""What decode and verification steps cost on this CPU, timed at engine start-up for the draft gate.

A few requests with short random prompts are decoded through the engine's own scheduler and runner:
first plain steps of 8, 4, 2 and 1 of them (those a batch that speculates may run; a CPU may serve
them on a path of their own, engine.model.decode_stack), then steps of the last one with random
drafts, so that each computes 2, 3, 5, 9 ... rows up to num_speculative_tokens + 1, round after
round, each round with a step of one row for reference. Each shape is timed three times after a
warm-up step and the fastest time kept (another process on the CPU only ever slows a step down; the
steps served refine the times: engine.speculative.gate), and each verification's cost in steps of
one row is the median over the rounds of its ratio to the one-row step of its round.
The requests then go and the acceptance counts start at zero; their full blocks may stay in the
prefix cache until evicted. Well under a second for a 135M model on one AVX2 core.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from engine.request import Request
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative.gate import CostCurve, StepCosts
from engine.speculative.stats import SpecDecodeStats

BATCHES = (8, 4, 2, 1)
ROW_COUNTS = (2, 3, 5, 9, 17)
PROMPT_TOKENS = 16
TIMINGS = 4  # the first warms up


def calibrate(scheduler: Scheduler, runner: ModelRunner, vocab_size: int, max_model_len: int,
              max_drafts: int, max_batch: int | None) -> StepCosts:
    """The costs of plain steps of up to `max_batch` - 1 sequences (None: no limit) and of one
    request verifying 1 to `max_drafts` drafts (see the module); leaves the scheduler empty with
    fresh speculation counts."""
    batches = tuple(b for b in BATCHES if max_batch is None or b < max_batch)
    rows = (*(r for r in ROW_COUNTS if r <= max_drafts), max_drafts + 1)
    rng = random.Random(0)
    max_tokens = TIMINGS * (len(batches) + 1 + sum(rows)) + 1  # even if every random draft were accepted
    if PROMPT_TOKENS + max_tokens > max_model_len:
        raise ValueError(f"--speculative-config: gate: a context of {max_model_len} tokens is too short to time "
                         f"verification steps at start-up (it needs {PROMPT_TOKENS + max_tokens}); choose \"off\"")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [Request(f"speculation-calibration-{i}", [rng.randrange(vocab_size) for _ in range(PROMPT_TOKENS)],
                        params, max_model_len) for i in range(batches[0])]
    for request in requests:
        scheduler.add(request)
    try:
        while any(request.num_output_tokens == 0 for request in requests):  # the prompts
            _step(scheduler, runner)
        decode = []
        for batch in batches:
            scheduler.abort([request.request_id for request in requests[batch:]])
            decode.append(_fastest(scheduler, runner, lambda: None))
        # Round after round over the counts, with a step of one row for reference in each: a burst
        # of other work slows one timing of each, and a round's ratios hold however busy the CPU.
        counts = (1, *rows)
        rounds = []
        for _ in range(TIMINGS):
            seconds = []
            for count in counts:
                _draft(requests[0], count - 1, rng, vocab_size)
                seconds.append(_step(scheduler, runner))
            rounds.append(seconds)
        timed = rounds[1:]  # the first warms up
        # More rows never cost less than one.
        steps = tuple(max(1.0, statistics.median(r[index] / r[0] for r in timed)) for index in range(1, len(counts)))
    finally:
        scheduler.abort([request.request_id for request in requests])
        for request in requests:
            runner.forget(request.request_id)
        scheduler.spec_stats = SpecDecodeStats()
    return StepCosts(CostCurve(batches[::-1], tuple(decode[::-1])), CostCurve(rows, steps), decode[-1])


def _draft(request: Request, count: int, rng: random.Random, vocab_size: int) -> None:
    request.draft_token_ids = [rng.randrange(vocab_size) for _ in range(count)]


def _fastest(scheduler: Scheduler, runner: ModelRunner, before_step: Callable[[], None]) -> float:
    """The fastest of TIMINGS - 1 steps after a warm-up one, each after `before_step()`."""
    fastest = float("inf")
    for timing in range(TIMINGS):
        before_step()
        seconds = _step(scheduler, runner)
        if timing > 0:
            fastest = min(fastest, seconds)
    return fastest


def _step(scheduler: Scheduler, runner: ModelRunner) -> float:
    """One step; the seconds of its forward pass (what the engine times of its steps)."""
    out = scheduler.schedule()
    started = time.perf_counter()
    sampled = runner.execute(out)
    seconds = time.perf_counter() - started
    scheduler.update(out, {rid: [token for token, _ in tokens] for rid, tokens in sampled.items()})
    return seconds
