"""What the engine reports after each step, and its load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_cache.kv_budget import KVBudget
from engine.sampler import TokenLogprobs
from engine.speculative.stats import SpecDecodeStats

if TYPE_CHECKING:
    from engine.kv_tiers.tiers import TierStats
    from engine.lora.states import AdapterState


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
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed for this request so far
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass(frozen=True)
class StepTokens:
    """What one step computed: prompt (or recomputed) tokens and single decode tokens, the context
    tokens those decode tokens attended to, and with speculation the drafts verified and the tokens
    gained."""

    prefill: int = 0  # draft rows included: they cost what prompt tokens cost
    decode: int = 0
    decode_context: int = 0
    draft: int = 0  # speculative decoding: draft tokens the decoding sequences verified
    decode_tokens: int = 0  # tokens the decoding sequences gained (decode, or more with drafts)


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
    block_size: int  # tokens per KV block
    max_num_batched_tokens: int  # the scheduler's token budget per step (a prompt's chunk size)
    num_context_tokens: int = 0  # tokens of context the running requests attend to
    spec_decode: SpecDecodeStats | None = None  # totals so far, where the engine speculates
    num_preemptions: int = 0  # requests preempted so far (their KV dropped, to recompute later)
    # Lower KV tiers (engine.kv_tiers): each configured tier's counters and contents, and prompt tokens
    # looked up there after a device prefix miss and loaded back (vLLM's external prefix cache).
    kv_tiers: Mapping[str, TierStats] = field(default_factory=dict)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_tier_dropped_blocks: int = 0  # blocks not copied down: the tiers' writes were too far behind
    # Seconds the steps' forwards waited for loads' layers, and of those before the first layer.
    kv_tier_load_wait_s: float = 0.0
    kv_tier_first_layer_wait_s: float = 0.0
    # LoRA (--enable-lora): the adapters served and their requests, and how many fit one step (0: none).
    lora_adapters: tuple[AdapterState, ...] = ()
    max_loras: int = 0
    # Under a KV budget: steps so far by the attention they ran, "scored" (gathered held blocks and
    # scored them) or "regular" (the backend without a budget: no query scored, no block freed).
    kv_budget_steps: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KVReservation:
    """The blocks reserved for an incoming prompt's KV (engine.kv_connector).

    The first `num_cached_tokens // block_size` blocks were already in this engine's prefix
    cache, or are hidden by its sliding window (never held: engine.kv_cache.manager.FREED); only
    the rest must be filled by the sender. Every write into them names the reservation
    (`ticket` tells it from an earlier one of the same request id).
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_size: int
    ticket: int
    # Under a KV budget (engine.kv_cache.kv_budget): the budget the sender must pick the prompt's
    # kept blocks by. The table then holds only as many blocks as it keeps (the rest FREED) until
    # start_decode places them where the sender says.
    budget: KVBudget | None = None
    # The fingerprint of the LoRA adapter the request runs under (b"": the base): the sender must
    # compute the prompt under the same (engine.lora.identity).
    adapter_fingerprint: bytes = b""

    @property
    def blocks_to_fill(self) -> tuple[int, ...]:
        """The block ids whose KV must arrive from the prefill side."""
        # Entries of blocks never held are negative (engine.kv_cache.manager.FREED).
        return tuple(block for block in self.block_ids[self.num_cached_tokens // self.block_size :] if block >= 0)


@dataclass(frozen=True)
class NoKVRoom:
    """A reservation refused because the cache has too few free blocks now."""

    needed_blocks: int
    free_blocks: int

    def __str__(self) -> str:
        return f"the prompt needs {self.needed_blocks} blocks, {self.free_blocks} are free"


@dataclass(frozen=True)
class TooLargeForKV:
    """Decode role: a reservation refused because the prompt needs more blocks than the whole cache
    has (another engine, with a larger cache, may take it)."""

    num_prompt_tokens: int
    needed_blocks: int
    total_blocks: int

    def __str__(self) -> str:
        return (f"prompt: {self.num_prompt_tokens} tokens need {self.needed_blocks} KV blocks but the cache "
                f"has {self.total_blocks}")


# What Engine.reserve answers: the blocks, or why not.
ReserveResult = KVReservation | NoKVRoom | TooLargeForKV
