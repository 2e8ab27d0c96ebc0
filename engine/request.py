"""A request's state inside one engine: tokens, progress through the model, and outcome."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_cache.block_hash import first_block_key
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.state import GrammarState


class RequestStatus(enum.Enum):
    """Where a request is in its life inside the engine."""

    WAITING = "waiting"  # queued for its first (or, after preemption, next) schedule
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks reserved, pages still arriving
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why generation ended; values are the OpenAI API's strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    HANDOFF = "handoff"  # prefill role: prompt done, first token sampled, decode continues elsewhere


@dataclass(eq=False)
class Request:
    """One sequence. `token_ids` is prompt + output so far; the model has computed the KV of the
    first `num_computed_tokens` of them."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Speculative decoding: tokens proposed to follow token_ids, verified by the next step.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # proposed over the request's life
    num_accepted_tokens: int = 0  # of those, verified and kept
    # The acceptance estimate and probe clock of engine.speculative.gate.
    drafts_accepted: float = 0.0
    drafts_rejected: float = 0.0
    silent_steps: int = 0
    shadow_token_ids: list[int] = field(default_factory=list)  # drafts proposed, not verified, from...
    shadow_from: int = 0  # ...this token index on
    # Structured output: where the request is in its grammar (engine.structured), None without one.
    grammar: GrammarState | None = None
    # Under a LoRA adapter (SamplingParams.lora_name): its fingerprint, and the runner's slot holding
    # it while the request runs (engine.lora.registry); b"" and None for the base model.
    adapter_fingerprint: bytes = b""
    lora_slot: int | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def first_block_key(self) -> bytes:
        """What its first KV block's hash takes after the tokens: its cache_salt and its adapter
        (engine.kv_cache.block_hash.first_block_key)."""
        return first_block_key(self.params.cache_salt, self.adapter_fingerprint)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        """Record one sampled token."""
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output after its first `num_output_tokens` tokens (a stop string that ended
        the request inside a run of verified tokens)."""
        del self.token_ids[self.num_prompt_tokens + num_output_tokens :]
