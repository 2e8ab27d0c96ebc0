"""What the API does with each request field OpenAI defines: honoured (a field of the body's schema),
accepted as a no-op (it changes nothing this server serves), or refused with a 400 naming it while
it is set to anything that would change the output (never served without it). Fields OpenAI does
not define are logged and ignored, as vLLM does.

tests/unit/test_field_policy.py walks the pinned `openai` SDK's parameters of
`chat.completions.create` and `completions.create` and checks that each is one of the three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Accepted and changing nothing served here: OpenAI's storage, billing, caching and abuse-monitoring
# hints (the prefix cache is automatic).
NO_OPS = frozenset({"store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                    "prompt_cache_options", "prompt_cache_retention"})


def _none(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return not value


# Refused while set to anything but a value that changes nothing (each predicate says which).
REFUSED: dict[str, Callable[[Any], bool]] = {
    "functions": _empty,
    "function_call": lambda value: value in (None, "none"),
    "best_of": lambda value: value in (None, 1),
    "suffix": _empty,
    "audio": _none,
    "modalities": lambda value: value in (None, ["text"]),
    "web_search_options": _none,
    "reasoning_effort": _none,
    "verbosity": _none,
    "moderation": _none,
}


def check_fields(extra: dict[str, Any]) -> list[str]:
    """The body's fields outside its schema (`model_extra`): ValueError naming the first that is
    refused; returns those OpenAI does not define (to log and ignore)."""
    for name, value in extra.items():
        if name in REFUSED and not REFUSED[name](value):
            raise ValueError(f"{name}: not served by this server (it would change the output); leave it unset")
    return [name for name in extra if name not in REFUSED and name not in NO_OPS]
