"""Timing a streamed response by its chunks, the way every client of the benchmarks and tests does:
TTFT from sending to the first chunk that carries tokens, TPOT the mean gap after it,
(last − first) / (tokens − 1). Standard library only: vLLM's interpreter imports it too."""

from __future__ import annotations

import time
from collections.abc import Callable


def tpot(first_at: float, last_at: float, tokens: int) -> float:
    """Mean seconds per output token after the first (0 for a single token)."""
    return (last_at - first_at) / (tokens - 1) if tokens > 1 else 0.0


class TokenTimer:
    """When one call started and when its token-carrying chunks arrived, read from `clock` (seconds)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started_at = clock()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.tokens = 0
        self.chunks = 0

    def add(self, tokens: int) -> None:
        """A chunk carrying `tokens` tokens arrived now (a chunk without any is not timed)."""
        if not tokens:
            return
        now = self.clock()
        if self.first_at is None:
            self.first_at = now
        self.last_at, self.tokens, self.chunks = now, self.tokens + tokens, self.chunks + 1

    @property
    def ttft_s(self) -> float | None:
        """Seconds from the start to the first token; None before it."""
        return None if self.first_at is None else self.first_at - self.started_at

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per token after the first; None for fewer than two tokens."""
        if self.first_at is None or self.last_at is None or self.tokens < 2:
            return None
        return tpot(self.first_at, self.last_at, self.tokens)
