"""Per-key rate limits, as OpenAI's API has them: requests a minute and tokens a minute.

Each limited key has a token bucket per limit, holding up to the per-minute figure and refilled
continuously at that figure a minute. A request takes one request and, once its prompt is
tokenized, its prompt tokens plus max_tokens (capped at the bucket's capacity, so that no request
waits for more than a full bucket); when it ends it is settled with the tokens it really used: the
difference is refunded or charged. A charge beyond what is left puts the bucket in debt, which
later requests wait out. A request is let in only when both buckets hold enough, and then takes
from both; otherwise it takes nothing and learns when to retry.

The clock is injected (time.monotonic by default) so that tests move time themselves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.caller import Caller, KeyLimits

Clock = Callable[[], float]


@dataclass(frozen=True)
class LimitStatus:
    """One limit of a key as a client sees it: the per-minute `limit`, what `remaining` is left
    (whole units, never below 0), and `reset_s` until the bucket is full again."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True)
class KeyStatus:
    """A limited key's limits now (None: the key has no such limit)."""

    requests: LimitStatus | None
    tokens: LimitStatus | None

    def fields(self) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* fields for the limits the key has: the per-minute limit, what is
        left, and when the bucket is full again (HTTP headers, gRPC trailers)."""
        fields = []
        for kind, limit in (("requests", self.requests), ("tokens", self.tokens)):
            if limit is not None:
                fields += [(f"x-ratelimit-limit-{kind}", str(limit.limit)),
                           (f"x-ratelimit-remaining-{kind}", str(limit.remaining)),
                           (f"x-ratelimit-reset-{kind}", duration(limit.reset_s))]
        return fields


def duration(seconds: float) -> str:
    """A wait as OpenAI writes it in x-ratelimit-reset-*: "250ms" below a second, else whole seconds
    rounded up, "45s" or "6m0s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, whole = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{whole}s" if minutes else f"{whole}s"


class RateLimited(Exception):
    """A request refused by its key's limits; `retry_after_s` until it would be let in."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TokenBucket:
    """Holds up to `capacity`, refilled continuously at `capacity` a minute; may go into debt."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self._level = float(capacity)
        self._at = now

    def level(self, now: float) -> float:
        """What the bucket holds at `now` (negative: in debt)."""
        if now > self._at:
            self._level = min(float(self.capacity), self._level + (now - self._at) * self.capacity / 60)
            self._at = now
        return self._level

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds `amount` (0: it does now)."""
        return max(0.0, (amount - self.level(now)) * 60 / self.capacity)

    def take(self, amount: float, now: float) -> None:
        """Take `amount` out (a negative amount gives it back, up to the capacity)."""
        self._level = min(float(self.capacity), self.level(now) - amount)

    def status(self, now: float) -> LimitStatus:
        """The bucket as the x-ratelimit-* headers tell it."""
        level = self.level(now)
        return LimitStatus(self.capacity, max(0, math.floor(level)), (self.capacity - level) * 60 / self.capacity)


class Charge:
    """The tokens one admitted request was charged; `settle` it once with what it used."""

    def __init__(self, bucket: TokenBucket | None, tokens: int, clock: Clock) -> None:
        self.tokens = tokens
        self._bucket = bucket
        self._clock = clock
        self._settled = False

    def settle(self, used_tokens: int) -> None:
        """Refund what the request was charged beyond `used_tokens`, or charge what it used beyond
        it; later calls do nothing."""
        if self._settled:
            return
        self._settled = True
        if self._bucket is not None:
            self._bucket.take(used_tokens - self.tokens, self._clock())


class _KeyBuckets:
    """A limited key's buckets (None where it has no such limit)."""

    def __init__(self, limits: KeyLimits, now: float) -> None:
        self.requests = TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute else None
        self.tokens = TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None


class RateLimiter:
    """The buckets of every limited key, by name (the keys are known at start-up, so they are few)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._keys: dict[str, _KeyBuckets] = {}

    def admit(self, caller: Caller | None, tokens: int) -> Charge:
        """Let a request of `tokens` (prompt plus max_tokens) in for `caller` and charge it, or raise
        RateLimited without charging anything. A caller without limits (or none) always gets in."""
        buckets = self._buckets(caller)
        if buckets is None:
            return Charge(None, 0, self._clock)
        now = self._clock()
        charged = min(tokens, buckets.tokens.capacity) if buckets.tokens is not None else 0
        waits = []
        if buckets.requests is not None:
            waits.append((buckets.requests.wait_s(1, now), "requests", buckets.requests.capacity))
        if buckets.tokens is not None:
            waits.append((buckets.tokens.wait_s(charged, now), "tokens", buckets.tokens.capacity))
        wait_s, kind, limit = max(waits)
        if wait_s > 0:
            assert caller is not None  # only a caller has buckets
            raise RateLimited(f"key {caller.name!r}: rate limit of {limit} {kind} per minute reached; "
                              f"retry in {math.ceil(wait_s)} s", wait_s)
        if buckets.requests is not None:
            buckets.requests.take(1, now)
        if buckets.tokens is not None:
            buckets.tokens.take(charged, now)
        return Charge(buckets.tokens, charged, self._clock)

    def status(self, caller: Caller | None) -> KeyStatus | None:
        """The caller's limits now; None for a caller without limits (or none)."""
        buckets = self._buckets(caller)
        if buckets is None:
            return None
        now = self._clock()
        return KeyStatus(buckets.requests.status(now) if buckets.requests is not None else None,
                         buckets.tokens.status(now) if buckets.tokens is not None else None)

    def _buckets(self, caller: Caller | None) -> _KeyBuckets | None:
        if caller is None or not caller.limits.limited:
            return None
        buckets = self._keys.get(caller.name)
        if buckets is None:
            buckets = self._keys[caller.name] = _KeyBuckets(caller.limits, self._clock())
        return buckets
