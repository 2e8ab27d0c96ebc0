"""The limits the gateway puts on a client's request, on both APIs (gRPC and HTTP).

Token limits are checked once the prompt is tokenized, before any worker is chosen; the model's
context bounds them as well, so an unset limit means "as much as the context allows". The HTTP
limits (body size, requests in flight) are enforced by the HTTP API (services.gateway.openai_api).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config_flags import flag

# A batch of 64 prompts of a few thousand tokens each, as JSON token ids, fits with room to spare.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024


@dataclass(frozen=True)
class RequestLimits:
    """`max_prompt_tokens`: longest prompt (None: the context less one token for the output).
    `max_total_tokens`: longest prompt plus `max_tokens` (None: the context).
    `max_body_bytes`: largest HTTP request body (413 beyond).
    `max_concurrent_requests`: HTTP API requests in flight at once, streams included (429 beyond)."""

    max_prompt_tokens: int | None = flag(None, "longest prompt, in tokens (default: the model's context less one)")
    max_total_tokens: int | None = flag(None, "longest prompt plus max_tokens (default: the model's context)")
    max_body_bytes: int = flag(DEFAULT_MAX_BODY_BYTES, "largest HTTP request body; larger ones get 413")
    max_concurrent_requests: int = flag(DEFAULT_MAX_CONCURRENT_REQUESTS,
                                        "HTTP API requests in flight at once (streams included); beyond it 429")

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_total_tokens", "max_body_bytes", "max_concurrent_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if (self.max_prompt_tokens is not None and self.max_total_tokens is not None
                and self.max_prompt_tokens >= self.max_total_tokens):
            raise ValueError(f"max_prompt_tokens: must be below max_total_tokens={self.max_total_tokens} "
                             f"(room for output), got {self.max_prompt_tokens}")

    def total_tokens(self, max_model_len: int) -> int:
        """The most tokens (prompt plus output) a request may have with a model of that context."""
        return min(max_model_len, self.max_total_tokens or max_model_len)

    def check(self, prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        """ValueError naming the field and the limit when a prompt of `prompt_tokens` tokens, asking
        for `max_tokens` more (None: not given), exceeds a limit or the model's context."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise ValueError(f"prompt: {prompt_tokens} tokens exceed the limit of {self.max_prompt_tokens} "
                             f"prompt tokens (max_prompt_tokens)")
        total = self.total_tokens(max_model_len)
        if prompt_tokens >= total:
            raise ValueError(f"prompt: {prompt_tokens} tokens leave no room for output within the limit of "
                             f"{total} total tokens ({self._total_name(max_model_len)})")
        if max_tokens is not None and prompt_tokens + max_tokens > total:
            raise ValueError(f"max_tokens: {max_tokens} with the prompt's {prompt_tokens} tokens exceeds the "
                             f"limit of {total} total tokens ({self._total_name(max_model_len)}); "
                             f"at most {total - prompt_tokens}")

    def _total_name(self, max_model_len: int) -> str:
        if self.max_total_tokens is not None and self.max_total_tokens < max_model_len:
            return "max_total_tokens"
        return "max_model_len"


DEFAULT_REQUEST_LIMITS = RequestLimits()
