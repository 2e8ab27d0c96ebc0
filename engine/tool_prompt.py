"""Tools in a chat prompt, for a chat template that has no tools section of its own.

A template that reads `tools` (Hermes, Qwen, Llama 3.1 and most recent ones) renders the tools, the
assistant's calls and the tools' results itself. One that does not (SmolLM2's plain ChatML) would
drop them silently; for it the conversation is rewritten into plain messages in the Hermes format,
which the `hermes` tool-call parser reads back:

- the tools, as JSON lines inside <tools></tools>, with the instruction to answer a call as
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, go at the end of the system message
  (one is added at the start when there is none);
- an assistant message's `tool_calls` follow its text, each as such a <tool_call> block;
- a `tool` message becomes a user message holding <tool_response>{result}</tool_response>.

This is Tandem's documented default tool prompt (docs/architecture.md, "Tool calling");
`--chat-template` replaces the model's template with one that has its own tools section.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_TOOLS_HEADER = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n")
DEFAULT_TOOLS_FOOTER = (
    "\n</tools>\nFor each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>")


def template_arguments(arguments: str) -> Any:
    """A call's `arguments` (a JSON string, as OpenAI sends it) as templates expect them: the parsed
    object (Hugging Face templates apply `tojson` to it); text that is not JSON is kept as text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def hermes_call(name: str, arguments: str) -> str:
    """One call as the Hermes format writes it."""
    body = json.dumps({"name": name, "arguments": template_arguments(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def with_default_tool_prompt(messages: Sequence[Mapping[str, Any]],
                             tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation rewritten as plain {role, content} messages in the Hermes format (above).
    `messages` as OpenAI sends them (assistant `tool_calls`, `tool` messages); `tools`: OpenAI's
    tool objects ({"type": "function", "function": {...}}); none: the tools are not described."""
    rewritten: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [hermes_call(call["function"]["name"], call["function"].get("arguments", "{}"))
                     for call in message["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        rewritten.append({"role": role, "content": content})
    if tools:
        described = DEFAULT_TOOLS_HEADER + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools) + \
            DEFAULT_TOOLS_FOOTER
        if rewritten and rewritten[0]["role"] == "system":
            rewritten[0]["content"] = f"{rewritten[0]['content']}\n\n{described}"
        else:
            rewritten.insert(0, {"role": "system", "content": described})
    return rewritten
