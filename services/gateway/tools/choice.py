"""What a chat request's `tools` and `tool_choice` ask of the reply: the constraint the workers
enforce and the parser that reads the calls back, as vLLM serves them.

- `none` (or no tools): plain content; the tools are not put in the prompt.
- a named function: the reply is constrained to its parameters' JSON schema, and is its arguments;
- `required`: constrained to a JSON array of {"name", "arguments"} objects, one per call (at most
  one without `parallel_tool_calls`), each matching its function's schema; arguments always parse
  and validate;
- `auto` (the default with tools): unconstrained, the calls parsed from the model's own format by
  `--tool-call-parser`, which the gateway serves only with `--enable-auto-tool-choice` (vLLM's flags).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import llguidance

from engine.structured.spec import StructuredOutput
from services.common.config_flags import flag
from services.gateway.tools.parsers import (
    FirstCallOnly,
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
    ToolCallParser,
)

PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
# A function declared without parameters takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolFlags:
    """The gateway's tool-calling flags, named as vLLM's."""

    enable_auto_tool_choice: bool = flag(
        False, "serve tool_choice \"auto\": the model decides whether to call a tool, its calls read from its text "
        "by --tool-call-parser")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = flag(
        None, "how the model writes tool calls, for tool_choice \"auto\": hermes (<tool_call>{...}</tool_call>, "
        "the default tool prompt's format) or llama3_json")
    chat_template: str | None = flag(
        None, "a Jinja chat template file to render chats with instead of the model's own (for example one with a "
        "tools section)", metavar="FILE")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and parameters' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(_NO_PARAMETERS))

    @classmethod
    def declared(cls, name: str, description: str, parameters: dict[str, Any] | None) -> Tool:
        """The tool as a request declares it (`parameters` None: it takes no arguments)."""
        return cls(name, description) if parameters is None else cls(name, description, parameters)

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's tool object (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def checked_tools(tools: list[Tool]) -> list[Tool]:
    """The tools, each name unique and each parameters a JSON schema the grammar library compiles;
    ValueError naming `tools.N.function...`."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools.{index}.function"
        if not tool.name or tool.name in seen:
            raise ValueError(f"{where}.name: {'empty' if not tool.name else f'{tool.name!r} given twice'}")
        seen.add(tool.name)
        try:
            jsonschema.validators.validator_for(tool.parameters).check_schema(tool.parameters)
            llguidance.LLMatcher.grammar_from_json_schema(tool.parameters)
        except (jsonschema.SchemaError, ValueError) as error:
            reason = error.message if isinstance(error, jsonschema.SchemaError) else str(error)
            raise ValueError(f"{where}.parameters: not a JSON schema this server can enforce: {reason}") from None
    return tools


@dataclass(frozen=True)
class ToolUse:
    """How one request's reply is constrained and read: `constraint` None leaves it free; `parser`
    None means the reply is plain content."""

    constraint: StructuredOutput | None
    parser: ToolCallParser | None
    render_tools: bool  # whether the prompt describes the tools


def tool_use(tools: list[Tool], choice: str | None, parallel: bool, flags: ToolFlags) -> ToolUse:
    """The ToolUse of a request (`choice`: "none", "auto", "required" or a function's name; None:
    "auto" with tools, as OpenAI defaults it); ValueError naming `tool_choice` or `tools`."""
    if choice not in (None, "none", "auto") and not tools:
        named = "is \"required\"" if choice == "required" else f"names function {choice!r}"
        raise ValueError(f"tool_choice: {named} but the request has no tools")
    if not tools or choice == "none":
        return ToolUse(None, None, render_tools=False)
    if choice in (None, "auto"):
        if not (flags.enable_auto_tool_choice and flags.tool_call_parser):
            raise ValueError("tool_choice: \"auto\" (the default with tools) needs the gateway started with "
                             "--enable-auto-tool-choice and --tool-call-parser; or ask for \"required\" or a "
                             "named function")
        parser = PARSERS[flags.tool_call_parser]()
        return ToolUse(None, parser if parallel else FirstCallOnly(parser), render_tools=True)
    if choice == "required":
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}
        if not parallel:
            calls["maxItems"] = 1
        return ToolUse(_compact(calls), RequiredParser(), render_tools=True)
    named = next((tool for tool in tools if tool.name == choice), None)
    if named is None:
        raise ValueError(f"tool_choice: no tool is named {choice!r} (tools: {', '.join(t.name for t in tools)})")
    return ToolUse(_compact(named.parameters), NamedParser(named.name), render_tools=True)


def _compact(schema: dict[str, Any]) -> StructuredOutput:
    # Arguments as OpenAI writes them, without the layout whitespace a free JSON grammar lets a
    # model spend tokens on.
    return StructuredOutput("json", json.dumps(schema), whitespace_flexible=False)


def _call_schema(tool: Tool) -> dict[str, Any]:
    # "name" before "arguments": the calls stream once their name is written.
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
