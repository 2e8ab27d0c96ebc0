"""One choice's reply with tools, streamed as OpenAI's deltas: content, then `tool_calls[i]` (the
first delta of a call carries its id, type and name, the later ones fragments of its arguments).

Each delta is the difference between two readings of the text so far (services.gateway.tools.parsers),
so what is streamed reassembles into the non-streamed reply of the same text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.tools.parsers import Reading, ToolCallParser


def call_id() -> str:
    """A fresh tool call id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def message(reading: Reading, ids: list[str]) -> dict[str, Any]:
    """The assistant message of a finished reply (`ids`: its calls' ids, in order)."""
    body: dict[str, Any] = {"role": "assistant", "content": reading.content}
    if reading.calls:
        body["tool_calls"] = [{"id": ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}
                              for index, call in enumerate(reading.calls)]
    return body


def finish_reason(parser: ToolCallParser, reading: Reading, engine_reason: str | None) -> str | None:
    """A reply that stopped after its calls finishes with "tool_calls", as OpenAI's do (a named
    function's: "stop", as OpenAI's and vLLM's)."""
    return "tool_calls" if reading.calls and engine_reason == "stop" and parser.finishes_as_calls else engine_reason


@dataclass
class ToolCallStream:
    """The deltas of one choice, fed its growing text."""

    parser: ToolCallParser
    text: str = ""
    ids: list[str] = field(default_factory=list)
    _content: str = ""
    _arguments: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[dict[str, Any], Reading]:
        """Add `text`; the delta of what became certain (empty: nothing yet) and the reading."""
        self.text += text
        reading = self.parser.read(self.text, final)
        delta: dict[str, Any] = {}
        content = reading.content or ""
        if content.startswith(self._content) and len(content) > len(self._content):
            delta["content"] = content[len(self._content):]
            self._content = content
        calls = []
        for index, call in enumerate(reading.calls):
            if index == len(self._arguments):
                self.ids.append(call_id())
                self._arguments.append("")
                calls.append({"index": index, "id": self.ids[index], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif call.arguments.startswith(self._arguments[index]) and len(call.arguments) > len(
                    self._arguments[index]):
                calls.append({"index": index, "function": {"arguments": call.arguments[len(self._arguments[index]):]}})
            else:
                continue
            self._arguments[index] = call.arguments
        if calls:
            delta["tool_calls"] = calls
        return delta, reading
