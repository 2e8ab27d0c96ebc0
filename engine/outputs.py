"""What the engine reports after each step, and its load."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampler import TokenLogprobs


@dataclass(frozen=True)
class RequestOutput:
    """The tokens and text one request gained in one step (or its final state)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "handoff" (prefill role)
    logprobs: tuple[TokenLogprobs, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class StepTokens:
    """What one step computed: prompt (or recomputed) tokens and single decode tokens, and the
    context tokens those decode tokens attended to."""

    prefill: int = 0
    decode: int = 0
    decode_context: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for routing and metrics."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_cached_blocks: int
    kv_usage: float
    num_context_tokens: int = 0  # tokens of context the running requests attend to


@dataclass(frozen=True)
class KVReservation:
    """Decode role: the blocks reserved for an incoming prompt.

    The first `num_cached_tokens // block_size` blocks were already in this engine's prefix
    cache; only the rest must be filled by the sender.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_size: int

    @property
    def blocks_to_fill(self) -> tuple[int, ...]:
        """The block ids whose KV must arrive from the prefill side."""
        return self.block_ids[self.num_cached_tokens // self.block_size :]
