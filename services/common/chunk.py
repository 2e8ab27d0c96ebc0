"""A request's token stream as plain data, the same for the gateway's core and its clients.

The gateway relays the decode worker's TokenChunk messages; its protocol-neutral core and the
Python client both see them as these dataclasses, so no protobuf type leaves an edge.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and, if asked for, its best alternatives as (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Timings:
    """Where a finished request's time went, in seconds, as the workers measured it."""

    ttft_s: float
    tpot_s: float
    prefill_queue_s: float
    prefill_compute_s: float
    kv_wait_s: float
    e2e_s: float
    kv_delivery_wait_s: float = 0.0  # the prefill worker's wait for delivery after its first token
    reserve_s: float = 0.0  # disaggregated: arrival at the decode worker to its KV blocks reserved
    batch_join_s: float = 0.0  # disaggregated: the KV complete to joining the decode batch


@dataclass(frozen=True)
class Chunk:
    """What a request gained since the previous chunk; the last one has finish_reason, usage and timings."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None  # "stop", "length" or "abort" on the last chunk
    usage: Usage | None
    timings: Timings | None
