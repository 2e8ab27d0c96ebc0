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
    """Where a finished request's time went, in seconds, as the workers measured it.

    The one record of a request's timings: its fields are those of the `Timings` proto, name for name
    (convert.py maps them by name, and a test holds the two equal), so a new timing is a field here
    and in the proto, plus where the decode worker works it out (services/decode/progress.py)."""

    ttft_s: float = 0.0  # arrival at the decode worker to its first token leaving it
    tpot_s: float = 0.0  # mean time per output token after the first
    prefill_queue_s: float = 0.0  # waiting in the prefill worker's queue
    prefill_compute_s: float = 0.0  # the prefill forward passes
    kv_wait_s: float = 0.0  # the decode worker's wait for the prompt's KV after the first token arrived
    e2e_s: float = 0.0  # end to end at the decode worker
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
