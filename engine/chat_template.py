"""Chat templates: the Jinja program a model ships to turn a conversation into its prompt text.

Rendered in a sandbox, with the globals and filters Hugging Face templates expect. Imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.tool_prompt import template_arguments, with_default_tool_prompt


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_strings: Mapping[str, str]) -> None:
        """Compile `source`; ValueError if it is not valid Jinja."""
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        self.has_tools = False
        try:
            self._template = environment.from_string(source)
            # Whether it renders tools itself (engine.tool_prompt rewrites the conversation for one that does not).
            self.has_tools = "tools" in meta.find_undeclared_variables(environment.parse(source))
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"chat template does not compile: {error}") from error
        self._special_strings = dict(special_strings)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] = ()) -> str:
        """The prompt text of a conversation; ValueError if the messages are malformed or rejected.

        OpenAI's assistant `tool_calls`, `tool` messages and tool objects (`tools`): a template that
        `has_tools` renders them itself (each call's arguments parsed, as Hugging Face templates
        expect them); for one without, engine.tool_prompt rewrites them in the default tool format.
        """
        conversation = _validated_messages(messages)
        extra: dict[str, Any] = {}
        if self.has_tools:
            conversation = [_parsed_calls(message) for message in conversation]
            extra = {"tools": list(tools)} if tools else {}
        elif tools or any(message.get("tool_calls") or message["role"] == "tool" for message in conversation):
            conversation = with_default_tool_prompt(conversation, tools)
        try:
            return self._template.render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **extra, **self._special_strings
            )
        except (jinja2.TemplateError, TypeError) as error:  # TypeError: content the template cannot combine
            raise ValueError(f"chat template rejected the messages: {error}") from error


def _validated_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} mappings")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] is not a mapping")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{index}]['{key}'] must be a string")
        conversation.append(dict(message))
    return conversation


def _parsed_calls(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"], "arguments": template_arguments(call["function"].get(
        "arguments", "{}"))}} for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON, as HF renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
