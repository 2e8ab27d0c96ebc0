"""Perplexity of text decoded one token at a time through the engine's own steps, each step's next
token being the text's (teacher forcing): what a KV policy that acts while decoding (eviction under
a KV budget) does to quality, where the fidelity suite's chunked perplexity never decodes.

The engine's sampler is swapped for `ForcedSampler`, which records each row's log-probability of
the text's next token and returns that token, so the scheduler, the KV cache manager and the
attention run exactly as when serving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.engine import Engine
from engine.offline import generate
from engine.sampler import SamplingRequestState, TokenLogprobs
from engine.sampling_params import SamplingParams


class ForcedSampler:
    """Samples each window's next token, summing the negative log-likelihood the model gave it."""

    def __init__(self, windows: Sequence[Sequence[int]], prompt_tokens: int, vocab_size: int) -> None:
        self._windows = {tuple(window[:prompt_tokens]): list(window) for window in windows}
        self._vocab_size = vocab_size
        self.nll_sum = 0.0
        self.count = 0

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingRequestState]
               ) -> list[tuple[int, TokenLogprobs | None]]:
        """The text's next token for each row (the row's window, at its prompt and output so far)."""
        logprobs = torch.log_softmax(logits[:, :self._vocab_size].float(), dim=-1)
        tokens = []
        for row, state in enumerate(states):
            window = self._windows[tuple(state.prompt_token_ids)]
            target = window[len(state.prompt_token_ids) + len(state.output_token_ids)]
            self.nll_sum -= float(logprobs[row, target])
            self.count += 1
            tokens.append((target, None))
        return tokens


def forced_perplexity(engine: Engine, windows: Sequence[Sequence[int]], prompt_tokens: int) -> float:
    """exp(mean NLL) of every window's tokens after its first `prompt_tokens`, the windows decoded
    together as a batch, each after its first `prompt_tokens` as a prompt."""
    sampler = ForcedSampler(windows, prompt_tokens, engine.model_config.vocab_size)
    kept, engine.runner.sampler = engine.runner.sampler, sampler  # type: ignore[assignment]
    try:
        lengths = {len(window) for window in windows}
        if len(lengths) != 1:
            raise ValueError(f"windows: one length for the batch, got {sorted(lengths)}")
        params = SamplingParams(max_tokens=lengths.pop() - prompt_tokens, temperature=0.0, ignore_eos=True)
        generate(engine, [list(window[:prompt_tokens]) for window in windows], params)
    finally:
        engine.runner.sampler = kept
    return math.exp(sampler.nll_sum / sampler.count)
