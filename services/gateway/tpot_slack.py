"""How much stall a decoding request can still absorb and meet its TPOT objective.

A request's TPOT is its mean time per output token, (last token - first) / (tokens - 1). A prompt
prefilled on a decode worker stalls every request decoding there for the prompt's compute, once;
spread over the request's output that costs stall / (tokens - 1) of TPOT, so a request decoding
faster than its objective has room for it. The gateway knows when each request it streams got its
first token and how many tokens it delivered since, so it can tell how much room is left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(eq=False)  # identity: the gateway keeps them in sets
class DecodeProgress:
    """One request's decode as its gateway streams it."""

    max_tokens: int
    tpot_objective_s: float
    first_token_at: float | None = None  # time.monotonic() of the first token; None before it
    tokens: int = 0

    def delivered(self, tokens: int, now: float) -> None:
        """`tokens` more tokens reached the client at `now`."""
        if tokens and self.first_token_at is None:
            self.first_token_at = now
        self.tokens += tokens

    def slack_s(self, step_s: float, now: float) -> float:
        """Seconds of stall this request can absorb and still meet its TPOT objective, if each of
        its remaining tokens takes `step_s` (negative: it misses already)."""
        if self.max_tokens <= 1:
            return math.inf  # no second token, no TPOT
        elapsed = now - self.first_token_at if self.first_token_at is not None else 0.0
        remaining = self.max_tokens - max(self.tokens, 1)
        return self.tpot_objective_s * (self.max_tokens - 1) - elapsed - remaining * step_s
