"""Per-key rate limits (services.gateway.rate_limits) on an injected clock: the buckets refill
continuously, a refusal takes nothing and says when to retry, a charge is settled with what the
request used (refund or debt), and OpenAI's x-ratelimit-* headers tell the state."""

from __future__ import annotations

import pytest

from services.gateway.caller import Caller, KeyLimits
from services.gateway.openai_api.http_limits import rate_limit_headers
from services.gateway.rate_limits import KeyStatus, LimitStatus, RateLimited, RateLimiter, duration


class FakeClock:
    """Seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter() -> tuple[RateLimiter, FakeClock]:
    clock = FakeClock()
    return RateLimiter(clock), clock


def _refusal(limiter: RateLimiter, caller: Caller, tokens: int) -> RateLimited:
    with pytest.raises(RateLimited) as refused:
        limiter.admit(caller, tokens)
    return refused.value


def test_requests_refill_continuously_and_a_refusal_says_when_to_retry() -> None:
    limiter, clock = _limiter()
    caller = Caller("team-a", KeyLimits(requests_per_minute=2))
    limiter.admit(caller, 10)
    limiter.admit(caller, 10)
    refusal = _refusal(limiter, caller, 10)
    assert refusal.retry_after_s == pytest.approx(30.0)  # one request every 30 s at 2 a minute
    assert "'team-a'" in str(refusal) and "2 requests per minute" in str(refusal)
    clock.now += 29
    assert _refusal(limiter, caller, 10).retry_after_s == pytest.approx(1.0)
    clock.now += 1
    limiter.admit(caller, 10)
    assert limiter.status(caller) == KeyStatus(LimitStatus(2, 0, pytest.approx(60.0)), None)


def test_tokens_are_charged_at_admission_and_settled_with_what_was_used() -> None:
    limiter, clock = _limiter()
    caller = Caller("team-a", KeyLimits(tokens_per_minute=100))
    charge = limiter.admit(caller, 60)
    assert limiter.status(caller).tokens == LimitStatus(100, 40, pytest.approx(36.0))
    # 50 more do not fit in the 40 left: refused, taking nothing, until 10 more have refilled.
    assert _refusal(limiter, caller, 50).retry_after_s == pytest.approx(6.0)
    assert limiter.status(caller).tokens.remaining == 40
    charge.settle(20)  # it used 20 of the 60: 40 come back
    assert limiter.status(caller).tokens.remaining == 80
    charge.settle(0)  # settled once only
    assert limiter.status(caller).tokens.remaining == 80
    limiter.admit(caller, 50)
    clock.now += 600  # refilled to the capacity, no further
    assert limiter.status(caller).tokens == LimitStatus(100, 100, 0.0)


def test_using_more_than_charged_puts_the_bucket_in_debt() -> None:
    limiter, clock = _limiter()
    caller = Caller("team-a", KeyLimits(tokens_per_minute=100))
    limiter.admit(caller, 10).settle(130)
    assert limiter.status(caller).tokens == LimitStatus(100, 0, pytest.approx(78.0))  # -30 to 100
    assert _refusal(limiter, caller, 10).retry_after_s == pytest.approx(24.0)  # -30 to 10
    clock.now += 24
    limiter.admit(caller, 10)


def test_a_request_larger_than_the_bucket_is_charged_a_full_bucket() -> None:
    limiter, _ = _limiter()
    caller = Caller("team-a", KeyLimits(tokens_per_minute=100))
    charge = limiter.admit(caller, 500)
    assert charge.tokens == 100
    charge.settle(250)
    assert limiter.status(caller).tokens == LimitStatus(100, 0, pytest.approx(150.0))


def test_a_request_must_fit_both_limits_and_a_refusal_takes_from_neither() -> None:
    limiter, _ = _limiter()
    caller = Caller("team-a", KeyLimits(requests_per_minute=10, tokens_per_minute=100))
    limiter.admit(caller, 90)
    refusal = _refusal(limiter, caller, 20)
    assert "100 tokens per minute" in str(refusal)
    assert limiter.status(caller) == KeyStatus(LimitStatus(10, 9, pytest.approx(6.0)),
                                               LimitStatus(100, 10, pytest.approx(54.0)))


def test_keys_have_their_own_buckets_and_unlimited_callers_pass() -> None:
    limiter, _ = _limiter()
    limits = KeyLimits(requests_per_minute=1)
    first, second = Caller("team-a", limits), Caller("team-b", limits)
    limiter.admit(first, 1)
    limiter.admit(second, 1)
    _refusal(limiter, first, 1)
    for caller in (None, Caller("free")):
        for _ in range(100):
            limiter.admit(caller, 10**6).settle(10**6)
        assert limiter.status(caller) is None


@pytest.mark.parametrize(("seconds", "written"), [(0.0, "0s"), (0.0101, "11ms"), (1.0, "1s"), (44.2, "45s"),
                                                  (60.0, "1m0s"), (360.0, "6m0s"), (78.5, "1m19s")])
def test_waits_are_written_as_openai_writes_them(seconds: float, written: str) -> None:
    assert duration(seconds) == written


def test_the_headers_tell_the_limits_a_key_has() -> None:
    status = KeyStatus(LimitStatus(60, 59, 1.0), LimitStatus(20000, 19000, 3.0))
    assert rate_limit_headers(status) == [
        (b"x-ratelimit-limit-requests", b"60"), (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-reset-requests", b"1s"), (b"x-ratelimit-limit-tokens", b"20000"),
        (b"x-ratelimit-remaining-tokens", b"19000"), (b"x-ratelimit-reset-tokens", b"3s"),
    ]
    assert [name for name, _ in rate_limit_headers(KeyStatus(None, LimitStatus(5, 5, 0.0)))] == [
        b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens"]
