"""`--speculative-config`: which proposer drafts tokens and how many, in vLLM's JSON keys."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Literal, get_args

SpeculativeMethod = Literal["ngram", "draft_model"]
DraftQuantization = Literal["auto", "none", "gguf", "int8", "gptq", "awq"]  # engine.config.Quantization
DraftGateMode = Literal["cost", "off"]

# Verifying k drafts computes k + 1 rows per request; past this the rows cost more than a CPU step
# saves (a draft after 8 accepted ones is rarely right), and vLLM's users rarely go beyond it.
MAX_SPECULATIVE_TOKENS = 16
FLAG = "--speculative-config"


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{FLAG}: {key}: {message}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a decoding engine speculates.

    `method` "ngram" (prompt lookup): the continuation of the longest n-gram, of between
    `prompt_lookup_min` and `prompt_lookup_max` tokens, that ends the request's tokens and occurred
    earlier in them (prompt or output), the most recent occurrence first. "draft_model": a second,
    cheaper model's greedy tokens (engine.speculative.draft_model): `model`, a path with the target's
    vocabulary (None: the target's own file, a self-draft), loaded in `quantization` (vLLM's key;
    "auto": the file's own blocks where a kernel serves them), and with `draft_layers` (Tandem's key)
    only its first that many layers before its final norm and LM head (early exit; None: all).
    `disable_by_batch_size`: a step with this many running requests or more proposes nothing (a large
    batch already fills the machine, so extra verification rows would only slow it); None never disables.
    `gate` (Tandem's key): "cost" takes, each step, only the drafts that the requests' acceptance
    makes pay against verification costs timed at start-up on this CPU (engine.speculative.gate);
    "off" verifies every proposal, as vLLM does.
    """

    method: SpeculativeMethod = "ngram"
    # Defaults measured on a CPU (`python -m bench speculative`; docs/benchmarks.md): a verification
    # step streams the weights once whatever its rows, so 9 rows cost about what 5 do and the longer
    # drafts of copied spans pay; from 8 running requests on, a step's rows are no longer cheap and
    # drafts stop paying.
    num_speculative_tokens: int = 8
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    model: str | None = None
    quantization: DraftQuantization = "auto"
    draft_layers: int | None = None
    gate: DraftGateMode = "cost"

    def __post_init__(self) -> None:
        _require(self.method in get_args(SpeculativeMethod), "method",
                 f"unknown method {self.method!r} (choose from {', '.join(get_args(SpeculativeMethod))})")
        _require(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
                 f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        _require(self.prompt_lookup_min >= 1, "prompt_lookup_min", f"must be >= 1, got {self.prompt_lookup_min}")
        _require(self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max",
                 f"must be >= prompt_lookup_min={self.prompt_lookup_min}, got {self.prompt_lookup_max}")
        _require(self.quantization in get_args(DraftQuantization), "quantization",
                 f"unknown method {self.quantization!r} (choose from {', '.join(get_args(DraftQuantization))})")
        _require(self.gate in get_args(DraftGateMode), "gate",
                 f"unknown gate {self.gate!r} (choose from {', '.join(get_args(DraftGateMode))})")
        if self.method != "draft_model":
            for key in ("model", "draft_layers"):
                _require(getattr(self, key) is None, key, f"applies to method draft_model, not {self.method}")
        if self.draft_layers is not None:
            _require(self.draft_layers >= 1, "draft_layers", f"must be >= 1, got {self.draft_layers}")
        if self.disable_by_batch_size is not None:
            _require(self.disable_by_batch_size >= 2, "disable_by_batch_size",
                     f"must be >= 2 (or null), got {self.disable_by_batch_size}")

    def speculates(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests proposes drafts."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON object; ValueError naming the flag and the key for anything wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{FLAG}: not JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{FLAG}: must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(raw.keys() - known)
        if unknown:
            raise ValueError(f"{FLAG}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        for key, value in raw.items():
            expected = str if key in ("method", "model", "quantization", "gate") else int
            if value is None and key in ("disable_by_batch_size", "model", "draft_layers"):
                continue
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"{FLAG}: {key}: must be {'a string' if expected is str else 'an integer'}, "
                                 f"got {value!r}")
        return cls(**raw)
