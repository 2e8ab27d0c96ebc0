"""What a request's output must match: a JSON schema, any JSON object, a regex, one of fixed
choices, a Lark grammar or a structural tag (vLLM 0.32's `structured_outputs`, which OpenAI's
`response_format` maps onto), as the grammar text the library compiles (engine.structured.grammars).

The spec is plain data: it travels with the request to every worker that samples for it (the
prefill worker's first token, the decode worker's rest, a migrated request's new worker), and each
rebuilds the matcher from it and the tokens already generated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

import llguidance

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# A spec's text beyond this is refused before it is compiled: a schema that large is a runaway
# (a 118 MB nested schema took llguidance 19.5 s to refuse as too large, on an AMD EPYC core).
MAX_SPEC_BYTES = 256 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: `kind` and its text (a JSON schema or a structural tag as JSON, a regex, the
    choices as a JSON list of strings, a Lark grammar; "" for json_object). `whitespace_flexible`:
    JSON may have any whitespace between tokens (vLLM's default; `disable_any_whitespace` turns it
    off)."""

    kind: Kind
    text: str = ""
    whitespace_flexible: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs: unknown kind {self.kind!r} (one of {', '.join(KINDS)})")
        if len(self.text.encode()) > MAX_SPEC_BYTES:
            raise ValueError(f"structured_outputs.{self.kind}: {len(self.text.encode())} bytes, more than the "
                             f"{MAX_SPEC_BYTES} this server compiles")
        if self.kind == "json_object" and self.text:
            raise ValueError("structured_outputs.json_object: takes no text")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"structured_outputs.{self.kind}: must not be empty")
        if self.kind == "choice":
            choices = json.loads(self.text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        """One of `choices`, exactly."""
        return cls("choice", json.dumps(choices))

    @property
    def field(self) -> str:
        """The request field that names this constraint, for error messages."""
        return f"structured_outputs.{self.kind}"

    def grammar(self) -> str:
        """The text llguidance compiles (ValueError naming the field where it is not valid JSON)."""
        options = {"whitespace_flexible": self.whitespace_flexible}
        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=options)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        except ValueError as error:
            raise ValueError(f"{self.field}: {error}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(self.text)))
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        return _structural_tag(self.text)


def _structural_tag(text: str) -> str:
    """vLLM's structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`):
    free text in which each trigger opens one of the structures, whose body follows its schema."""
    try:
        tag = json.loads(text)
        structures = [llguidance.StructTag(trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                                           begin=s["begin"], grammar=s.get("schema", {}), end=s["end"])
                      for s in tag["structures"]]
        # A trigger is text the model writes, not one of its special tokens.
        return llguidance.StructTag.to_grammar(structures, assume_special=False)
    except (ValueError, KeyError, TypeError, StopIteration, AssertionError) as error:
        raise ValueError(f"structured_outputs.structural_tag: not a structural tag ({error!r}): it needs "
                         "\"structures\" of {\"begin\", \"schema\", \"end\"}, each begin starting with one of "
                         "its \"triggers\"") from None
