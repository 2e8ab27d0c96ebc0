"""vLLM's `--structured-outputs-config`, as far as it changes what a worker serves.

`backend`: "auto" and "guidance" are llguidance, the library this build compiles grammars with
(chosen by `python -m bench grammar_backends`); vLLM's other backends ("xgrammar", "outlines",
"lm-format-enforcer") are refused at start-up, never silently replaced. `disable_any_whitespace`:
every JSON constraint is compact, as if each request had set it. Keys that would change the output
and are not served (`disable_additional_properties`, the reasoning parser's) are refused by name.
A deployment gives every worker the same value, as it gives them the same model: the prefill
worker's first token and the decode worker's rest follow one grammar.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.structured.spec import StructuredOutput

FLAG = "--structured-outputs-config"
BACKENDS = ("auto", "guidance")
_VLLM_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")
_REFUSED = ("disable_additional_properties", "reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The grammar library (`backend`) and whether JSON is always compact."""

    backend: str = "auto"
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend in _VLLM_BACKENDS:
            raise ValueError(f"{FLAG}: backend: {self.backend!r} is not served; this build compiles grammars with "
                             "llguidance (vLLM's \"guidance\"), the library chosen by measurement")
        if self.backend not in BACKENDS:
            raise ValueError(f"{FLAG}: backend: unknown {self.backend!r} (choose from {', '.join(BACKENDS)})")

    @classmethod
    def from_json(cls, text: str) -> StructuredOutputsConfig:
        """The config of the flag's JSON, in vLLM's keys; ValueError naming the flag and the key."""
        try:
            given: Any = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{FLAG}: not JSON: {error}") from None
        if not isinstance(given, dict):
            raise ValueError(f"{FLAG}: must be a JSON object")
        for key, value in given.items():
            if key in _REFUSED and value:
                raise ValueError(f"{FLAG}: {key}: not served (it would change the output); leave it unset")
            if key not in _REFUSED and key not in {field.name for field in dataclasses.fields(cls)}:
                raise ValueError(f"{FLAG}: unknown key {key!r}")
        if not isinstance(given.get("disable_any_whitespace", False), bool):
            raise ValueError(f"{FLAG}: disable_any_whitespace: must be true or false")
        return cls(backend=str(given.get("backend", "auto")),
                   disable_any_whitespace=given.get("disable_any_whitespace", False))

    def applied(self, spec: StructuredOutput) -> StructuredOutput:
        """`spec` as this worker compiles it."""
        if self.disable_any_whitespace and spec.whitespace_flexible:
            return dataclasses.replace(spec, whitespace_flexible=False)
        return spec
