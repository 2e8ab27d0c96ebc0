"""Structured outputs in request bodies: OpenAI's `response_format` and vLLM's `structured_outputs`,
as the engine's StructuredOutput (engine.structured.spec), which the workers compile and enforce.

`response_format`: `text` (no constraint), `json_object`, `json_schema` (its `schema`; `strict` or
not, the output always matches it, as vLLM serves it) and vLLM's `structural_tag`. vLLM 0.32's
`structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar` (Lark), `json_object`,
`structural_tag`, with `disable_any_whitespace`. Its `whitespace_pattern` and
`disable_additional_properties` change the output, and the grammar library here serves neither: a
request that sets them is refused naming them, never served without them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.structured.spec import StructuredOutput


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`, with vLLM's structural tag (`structures`, `triggers`)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams' request fields)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


def structured_output(response_format: ResponseFormat | None,
                      structured: StructuredOutputsBody | None) -> StructuredOutput | None:
    """The constraint a body asks for (None: none); ValueError naming the field."""
    if response_format is not None and structured is not None and response_format.type != "text":
        raise ValueError("structured_outputs: give response_format or structured_outputs, not both")
    if structured is not None:
        return _from_structured_outputs(structured)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    if response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise ValueError("response_format.json_schema.schema: must be set for type json_schema")
        return _spec("response_format.json_schema.schema", "json", json.dumps(response_format.json_schema.schema_))
    if not response_format.structures or not response_format.triggers:
        raise ValueError("response_format.structures: a structural_tag needs structures and triggers")
    tag = {"structures": response_format.structures, "triggers": response_format.triggers}
    return _spec("response_format.structures", "structural_tag", json.dumps(tag))


def _from_structured_outputs(body: StructuredOutputsBody) -> StructuredOutput:
    if body.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern: not served (the guidance backend has no "
                         "whitespace pattern); use disable_any_whitespace")
    if body.disable_additional_properties:
        raise ValueError("structured_outputs.disable_additional_properties: not served; set "
                         "\"additionalProperties\": false in the schema")
    given = {"json": body.json_, "regex": body.regex, "choice": body.choice, "grammar": body.grammar,
             "json_object": body.json_object or None, "structural_tag": body.structural_tag}
    kinds = [kind for kind, value in given.items() if value is not None]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs: exactly one of {', '.join(given)} must be set, got "
                         f"{', '.join(kinds) or 'none'}")
    kind = kinds[0]
    value = given[kind]
    if kind == "json_object":
        text = ""
    elif kind == "choice" or (kind == "json" and isinstance(value, dict)):
        text = json.dumps(value)
    else:
        text = str(value)
    return _spec(f"structured_outputs.{kind}", kind, text, whitespace_flexible=not body.disable_any_whitespace)


def _spec(field: str, kind: str, text: str, whitespace_flexible: bool = True) -> StructuredOutput:
    """The StructuredOutput, its errors renamed to the body's field."""
    try:
        return StructuredOutput(kind, text, whitespace_flexible)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(f"{field}: {str(error).split(': ', 1)[-1]}") from None
