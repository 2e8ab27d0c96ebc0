"""Who sent a request, as the gateway's core sees it: the API key's name, limits, models and admin mark.

The API edges identify the key (services.gateway.api_keys) and hand the core this, never the
secret, so that nothing past the edge can log or leak it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Names label metrics and log lines: short, and safe in both.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class KeyLimits:
    """A key's rate limits, OpenAI's way: requests and tokens (prompt plus max_tokens at admission,
    settled with what the request used) a minute; None = unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            # bool is an int; `true` in a key file is a mistake, not a limit of 1.
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: must be a whole number > 0, got {value!r}")

    @property
    def limited(self) -> bool:
        """Whether any limit is set."""
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Caller:
    """The key a request came with: `name` (for metrics and logs), its `limits`, whether it is an
    `admin` key, and the `models` it may use (model names, without @VERSION, and LoRA adapter
    names; None: any)."""

    name: str
    limits: KeyLimits = field(default_factory=KeyLimits)
    admin: bool = False
    models: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"name: must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a letter "
                             f"or digit), got {self.name!r}")
        if self.models is not None and not self.models:
            raise ValueError("models: an empty list allows no model; leave it out to allow any")

    def may_use(self, model: str) -> bool:
        """Whether this key may send requests for `model` (a model's name or an adapter's)."""
        return self.models is None or model in self.models
