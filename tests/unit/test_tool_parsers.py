"""Tool calls read from fixed model text by each parser, whole and streamed: the deltas of every
way of cutting the text into chunks reassemble into the non-streamed reply."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
    ToolCallParser,
    held_back,
    json_value_end,
)
from services.gateway.tools.stream import ToolCallStream, finish_reason, message

HERMES = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": '
          '"a}\\"b"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
CASES = [
    (HermesParser(), HERMES, "Let me look that up.",
     [("get_weather", '{"city": "Paris", "note": "a}\\"b"}'), ("get_time", "{}")]),
    (HermesParser(), "Paris is sunny <tool", "Paris is sunny <tool", []),
    (HermesParser(), 'x <tool_call>{"name": "f", "arguments": {oops}}</tool_call>',
     'x <tool_call>{"name": "f", "arguments": {oops}}</tool_call>', []),
    (Llama3JsonParser(), '{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"x": [1, 2]}'), ("b", "{}")]),
    (Llama3JsonParser(), "Plain words {not a call}", "Plain words {not a call}", []),
    (RequiredParser(), '[{"name":"a","arguments":{"x":1}},{"name":"b","arguments":{"y":"]"}}]', None,
     [("a", '{"x":1}'), ("b", '{"y":"]"}')]),
    (NamedParser("g"), ' {"city": "Rome"} ', None, [("g", '{"city": "Rome"}')]),
]


def _streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[Any]]:
    stream = ToolCallStream(parser)
    content, calls, reasons = "", {}, []
    for position, piece in enumerate(pieces):
        delta, reading = stream.feed(piece, final=position == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
        reasons.append(finish_reason(parser, reading, "stop" if position == len(pieces) - 1 else None))
    return content or None, [tuple(call) for _, call in sorted(calls.items())], reasons


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_parser_reads_its_formats_calls_and_content(parser, text, content, calls):
    reading = parser.read(text, final=True)
    assert reading.content == content
    assert [(call.name, call.arguments) for call in reading.calls] == calls
    for call in reading.calls:
        json.loads(call.arguments)
    body = message(reading, [f"id{i}" for i in range(len(calls))])
    assert [c["function"]["name"] for c in body.get("tool_calls", [])] == [name for name, _ in calls]
    # A named function's reply finishes "stop", as OpenAI's and vLLM's do; other calls "tool_calls".
    called = "tool_calls" if calls and not isinstance(parser, NamedParser) else "stop"
    assert finish_reason(parser, reading, "stop") == called
    assert finish_reason(parser, reading, "length") == "length"


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [c for c in CASES if "oops" not in c[1]])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_deltas_reassemble_into_the_reply(parser, text, content, calls, size):
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    got_content, got_calls, reasons = _streamed(parser, pieces)
    assert (got_content, got_calls) == (content, calls)
    assert reasons[-1] == ("tool_calls" if calls and not isinstance(parser, NamedParser) else "stop")
    assert not any(reasons[:-1])


def test_a_call_streams_its_name_first_and_its_arguments_as_they_come():
    stream = ToolCallStream(RequiredParser())
    assert stream.feed('[{"name":"get_weather","argu', final=False)[0] == {}
    first, _ = stream.feed('ments":{"ci', final=False)
    [call] = first["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"ci'} and call["id"].startswith("chatcmpl-tool-")
    more, _ = stream.feed('ty":"Paris"}}]', final=True)
    assert more == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Paris"}'}}]}


def test_content_that_may_start_a_call_is_held_back():
    assert held_back("It is sunny <tool_c", "<tool_call>") == "It is sunny"
    assert held_back("It is sunny <b>", "<tool_call>") == "It is sunny <b>"
    assert HermesParser().read("Sunny.\n<tool_", final=False).content == "Sunny."


def test_json_value_end_skips_brackets_inside_strings():
    assert json_value_end('{"a": "}]", "b": [1, {"c": 2}]} tail', 0) == 31
    assert json_value_end('{"a": "\\"}"', 0) is None
