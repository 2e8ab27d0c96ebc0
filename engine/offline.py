"""Run a batch of prompts to completion on one engine: the CLI's and the tests' entry point."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class Completion:
    """The whole result of one request, with its latency figures."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0  # mean time per output token after the first


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[Completion]:
    """Submit every prompt at once and step the engine until all finish."""
    per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_request) != len(prompts):
        raise ValueError(f"params: got {len(per_request)} for {len(prompts)} prompts")
    start = time.perf_counter()
    by_id: dict[str, Completion] = {}
    first_at: dict[str, float] = {}
    last_at: dict[str, float] = {}
    order = []
    for prompt, p in zip(prompts, per_request, strict=True):
        request_id = f"offline-{next(_ids)}"
        engine.add_request(request_id, prompt, p)
        by_id[request_id] = Completion(prompt_token_ids=list(prompt))
        order.append(request_id)
    while engine.has_unfinished():
        for output in engine.step():
            now = time.perf_counter()
            completion = by_id[output.request_id]
            first_at.setdefault(output.request_id, now)
            last_at[output.request_id] = now
            completion.token_ids.extend(output.new_token_ids)
            completion.text += output.new_text
            completion.logprobs.extend(output.logprobs)
            completion.num_cached_tokens = output.num_cached_tokens
            if output.finished:
                completion.finish_reason = output.finish_reason
    for request_id, completion in by_id.items():
        completion.ttft_s = first_at[request_id] - start
        if len(completion.token_ids) > 1:
            completion.tpot_s = (last_at[request_id] - first_at[request_id]) / (len(completion.token_ids) - 1)
    return [by_id[r] for r in order]
