"""Tool calls read from a reply's text: the model's own format (`--tool-call-parser`: `hermes`,
`llama3_json`) for `tool_choice: "auto"`, and the JSON the grammar forces for `required` and for a
named function (services.gateway.tools.choice).

A parser reads the whole text so far, streaming or not: `read(text, final=False)` gives what is
certain already (the content before any call, holding back what may still start one; each call
once its name is known, its arguments as far as they are written), and `read(text, final=True)`
the reply. Streamed deltas are the differences between successive readings
(services.gateway.tools.stream), so they reassemble into the non-streamed reply. A call's
`arguments` is the JSON text the model wrote for them, as OpenAI sends it.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

# The start of a call object: its name, then its arguments (Llama 3 writes "parameters").
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class CallText:
    """One call as read so far: `arguments` is complete JSON once `complete`."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class Reading:
    """A reply's text split into its content and its calls (content None: none)."""

    content: str | None
    calls: tuple[CallText, ...]


class ToolCallParser(ABC):
    """Reads the calls out of one reply's text."""

    # Whether a reply that stopped after its calls finishes "tool_calls" (OpenAI's and vLLM's, but
    # for a named function: "stop").
    finishes_as_calls = True

    @abstractmethod
    def read(self, text: str, final: bool) -> Reading:
        """What `text` holds; with `final`, the reply (text whose calls do not parse is all content)."""


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array beginning at `start` ends (the index after it), or None while
    it is still open."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def read_call(text: str, start: int) -> tuple[CallText | None, int]:
    """The call object whose text begins at `start` (whitespace first allowed), and where it ends
    (len(text) while it is open). None while its name is not yet written, or when the text is
    not a call object."""
    head = _CALL_HEAD.match(text, start)
    if head is None:
        return None, len(text)
    name = json.loads(head.group(1))
    arguments_at = head.end()
    if arguments_at == len(text) or text[arguments_at] not in "{[":
        return (CallText(name, "", False) if arguments_at == len(text) else None), len(text)
    end = json_value_end(text, arguments_at)
    if end is None:
        return CallText(name, text[arguments_at:], False), len(text)
    close = re.compile(r"\s*\}").match(text, end)
    return CallText(name, text[arguments_at:end], close is not None), close.end() if close else len(text)


def held_back(text: str, marker: str) -> str:
    """`text` without a tail that may be the start of `marker` or whitespace before one."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            text = text[:-size]
            break
    return text.rstrip()


def _content(text: str) -> str | None:
    return text.strip() or None


class HermesParser(ToolCallParser):
    """Calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, after any content
    (Hermes, Qwen 2.5 and engine.tool_prompt's default tool prompt). The content is the text
    before the first call."""

    START, END = "<tool_call>", "</tool_call>"

    def read(self, text: str, final: bool) -> Reading:
        first = text.find(self.START)
        if first < 0:
            return Reading(_content(text if final else held_back(text, self.START)), ())
        calls = []
        for block in text[first + len(self.START):].split(self.START):
            body = block.split(self.END, 1)[0]
            found, rest = _call_list(body, 0, "")
            if final and not _whole(found, rest, "", 1):
                return Reading(_content(text), ())
            calls += found[:1]
        return Reading(_content(text[:first]), tuple(calls))


class Llama3JsonParser(ToolCallParser):
    """Llama 3's JSON calls: the reply is {"name": ..., "parameters": {...}} objects separated by
    ";", or else plain content."""

    def read(self, text: str, final: bool) -> Reading:
        if not text.lstrip().startswith("{"):
            return Reading(_content(text if final else text.rstrip()), ())
        calls, rest = _call_list(text, 0, ";")
        if final and not _whole(calls, rest, ""):
            return Reading(_content(text), ())
        return Reading(None, tuple(calls))


class RequiredParser(ToolCallParser):
    """`tool_choice: "required"`: the grammar forces a JSON array of {"name", "arguments"} objects."""

    def read(self, text: str, final: bool) -> Reading:
        opening = re.compile(r"\s*\[").match(text)
        calls, rest = _call_list(text, opening.end(), ",") if opening else ([], text)
        if final and not (opening and _whole(calls, rest, "]")):
            return Reading(_content(text), ())
        return Reading(None, tuple(calls))


class NamedParser(ToolCallParser):
    """A named function: the grammar forces the reply to be its arguments' JSON."""

    finishes_as_calls = False

    def __init__(self, name: str) -> None:
        self._name = name

    def read(self, text: str, final: bool) -> Reading:
        arguments = text.strip()
        if not arguments:
            return Reading(None, ())
        if final and not _parses(arguments):
            return Reading(_content(text), ())
        return Reading(None, (CallText(self._name, arguments, final),))


class FirstCallOnly(ToolCallParser):
    """`parallel_tool_calls: false` under auto: the reply is at most its first call (the grammar
    bounds required ones; auto's text may hold more)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self.finishes_as_calls = parser.finishes_as_calls

    def read(self, text: str, final: bool) -> Reading:
        reading = self._parser.read(text, final)
        return Reading(reading.content, reading.calls[:1])


def _call_list(text: str, start: int, separator: str) -> tuple[list[CallText], str]:
    """The call objects from `start`, each after whitespace and at most one `separator`, up to
    the first open one or the first text that does not start a call (returned: the text from there)."""
    calls: list[CallText] = []
    position = start
    gap = re.compile(rf"\s*{re.escape(separator)}?\s*" if separator else r"\s*")
    while True:
        if calls:
            position = gap.match(text, position).end()  # type: ignore[union-attr]
        call, end = read_call(text, position)
        if call is None:
            return calls, text[position:]
        calls.append(call)
        if not call.complete:
            return calls, ""
        position = end


def _whole(calls: list[CallText], rest: str, closing: str, most: int | None = None) -> bool:
    """Whether a finished reply's calls are complete, their arguments JSON, at least one (at most
    `most`) and nothing but `closing` after them."""
    return bool(calls) and (most is None or len(calls) <= most) and rest.strip() == closing and \
        all(call.complete and _parses(call.arguments) for call in calls)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
