"""A short profile of the engine at worker start-up, so the router has a step model before the
first real request (real steps refine it afterwards; see services.common.step_model)."""

from __future__ import annotations

import random
import time

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from services.common.step_model import StepModelFit

# Two prompt sizes give the prefill slope; two batch sizes at growing context give the decode terms.
_PROMPT_TOKENS = (32, 192)
_DECODE_BATCHES = (1, 4)
_DECODE_STEPS = 4
# Ordinary text tokens of most vocabularies: specials sit at the bottom.
_TOKEN_RANGE = (1000, 20000)


def profile_engine(engine: Engine, fit: StepModelFit, seed: int = 0) -> None:
    """Run a few prefill and decode steps on random prompts and record them into `fit`; leaves
    the engine empty (its prefix cache may keep the profile's blocks until they are evicted)."""
    rng = random.Random(seed)
    high = min(_TOKEN_RANGE[1], engine.model_config.vocab_size)
    low = min(_TOKEN_RANGE[0], high // 2)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(length)]

    decodes = engine.connector.scheduler.policy.decodes
    # The first run only warms up (first-call allocations would skew the fit).
    runs: list[list[list[int]]] = [[prompt(8)], *([prompt(n)] for n in _PROMPT_TOKENS)]
    if decodes:
        runs += [[prompt(16) for _ in range(batch)] for batch in _DECODE_BATCHES]
    max_tokens = 1 + _DECODE_STEPS if decodes else 1
    capacity = engine.kv.num_blocks * engine.kv.block_size
    for number, prompts in enumerate(runs):
        # A cache (or context) too small for a run skips it: the fit then has fewer points.
        if (sum(len(p) + max_tokens for p in prompts) > capacity - len(prompts) * engine.kv.block_size
                or max(map(len, prompts)) + max_tokens > engine.max_model_len):
            continue
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [f"startup-profile-{number}-{i}" for i in range(len(prompts))]
        for request_id, tokens in zip(ids, prompts, strict=True):
            engine.add_request(request_id, tokens, params)
        while engine.has_unfinished():
            started = time.perf_counter()
            outputs = engine.step()
            tokens_done = engine.last_step_tokens
            if number > 0:
                fit.record(tokens_done.prefill, tokens_done.decode, tokens_done.decode_context,
                           time.perf_counter() - started)
            for output in outputs:
                # A handed-off prompt keeps its blocks until released (engine.kv_connector).
                if not decodes and output.finished:
                    engine.release(output.request_id)
