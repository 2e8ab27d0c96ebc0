"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from engine.structured.spec import StructuredOutput


def _check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {message}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `top_k <= 0` disables top-k; `top_p == 1` and
    `min_p == 0` disable those filters. `seed` makes sampling reproducible for this request
    whatever else shares its batch.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; None = off
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # what the output must match (engine.structured)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100]), OpenAI's
    # OpenAI's `prediction`: the output the client expects, as tokens; a speculating engine drafts
    # from it (engine.speculative.ngram), which changes the speed only, never the tokens.
    prediction: tuple[int, ...] = ()
    # vLLM's `cache_salt`: not a sampling choice, but it travels wherever the request's sampling does
    # (prefill, decode, a migration). Hashed into the request's first KV block, so that only requests
    # carrying the same salt (one tenant's) share cached prefix blocks; "" for none.
    cache_salt: str = ""
    # The LoRA adapter to run under (engine.lora), by the name it is served as; "" for the base
    # model. Like cache_salt, not a sampling choice, but it travels wherever the sampling does.
    lora_name: str = ""

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", f"must be in [0, 2^63), got {self.seed}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}")
        for token, bias in self.logit_bias:
            _check(token >= 0, "logit_bias", f"token id {token} is negative")
            _check(-100.0 <= bias <= 100.0, "logit_bias",
                   f"the bias of token {token} must be in [-100, 100], got {bias}")
        _check(len({token for token, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias",
               "a token id is given twice")
        _check(isinstance(self.cache_salt, str), "cache_salt",
               f"must be a string, got {type(self.cache_salt).__name__}")
        _check(isinstance(self.lora_name, str), "lora_name", f"must be a string, got {type(self.lora_name).__name__}")

    @property
    def greedy(self) -> bool:
        """True when the next token is always the argmax."""
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty or a logit bias is active."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))
