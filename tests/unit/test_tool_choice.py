"""What `tools` and `tool_choice` make of a request: the constraint (whose every output parses as
calls that validate against the tools' schemas), the parser, the prompt's tools, and 400s naming
the field for tools and choices this server cannot serve."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.structured.spec import StructuredOutput
from services.gateway.openai_api.params import chat_prompt, chat_tools
from services.gateway.openai_api.schema import ChatBody
from services.gateway.tools.choice import Tool, ToolFlags, checked_tools, tool_use
from services.gateway.tools.parsers import HermesParser, Llama3JsonParser, NamedParser, RequiredParser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [Tool("get_weather", "weather of a city", WEATHER), Tool("get_time")]
AUTO = ToolFlags(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_no_tools_or_none_leaves_the_reply_free_and_the_prompt_without_tools():
    for tools, choice in (([], None), (TOOLS, "none")):
        use = tool_use(tools, choice, True, ToolFlags())
        assert (use.constraint, use.parser, use.render_tools) == (None, None, False)


def test_auto_needs_both_flags_and_reads_with_the_named_parser():
    for flags in (ToolFlags(), ToolFlags(enable_auto_tool_choice=True), ToolFlags(tool_call_parser="hermes")):
        for choice in (None, "auto"):
            with pytest.raises(ValueError, match=r"^tool_choice: .*--enable-auto-tool-choice and --tool-call-parser"):
                tool_use(TOOLS, choice, True, flags)
    assert isinstance(tool_use(TOOLS, None, True, AUTO).parser, HermesParser)
    llama = ToolFlags(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    use = tool_use(TOOLS, "auto", True, llama)
    assert isinstance(use.parser, Llama3JsonParser) and use.constraint is None and use.render_tools
    # Without parallel calls, auto's reply is at most its first call.
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}'
    assert len(tool_use(TOOLS, "auto", True, AUTO).parser.read(two, final=True).calls) == 2
    assert len(tool_use(TOOLS, "auto", False, AUTO).parser.read(two, final=True).calls) == 1


def test_a_named_function_constrains_the_reply_to_its_arguments():
    use = tool_use(TOOLS, "get_weather", True, ToolFlags())
    assert isinstance(use.parser, NamedParser) and json.loads(use.constraint.text) == WEATHER
    assert not use.constraint.whitespace_flexible
    with pytest.raises(ValueError, match=r"^tool_choice: no tool is named 'nope'"):
        tool_use(TOOLS, "nope", True, ToolFlags())
    with pytest.raises(ValueError, match=r"^tool_choice: names function 'f' but the request has no tools"):
        tool_use([], "f", True, ToolFlags())
    with pytest.raises(ValueError, match=r"^tool_choice: is \"required\" but the request has no tools"):
        tool_use([], "required", True, ToolFlags())


def test_required_constrains_to_calls_of_the_tools_each_validating():
    use = tool_use(TOOLS, "required", True, ToolFlags())
    schema = json.loads(use.constraint.text)
    assert isinstance(use.parser, RequiredParser) and "maxItems" not in schema
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert json.loads(tool_use(TOOLS, "required", False, ToolFlags()).constraint.text)["maxItems"] == 1
    for schema_text in (use.constraint.text, tool_use(TOOLS, "get_weather", True, ToolFlags()).constraint.text):
        StructuredOutput("json", schema_text).grammar()  # compiles


def test_tools_with_unusable_schemas_or_names_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"^tools\.1\.function\.parameters: not a JSON schema"):
        checked_tools([Tool("a"), Tool("b", "", {"type": "nope"})])
    with pytest.raises(ValueError, match=r"^tools\.1\.function\.name: 'a' given twice"):
        checked_tools([Tool("a"), Tool("a")])


def _body(**fields) -> ChatBody:
    return ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_body_with_tools_becomes_the_prompts_tools_and_the_constraint():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time"}}]
    use, described = chat_tools(_body(tools=tools, tool_choice={"type": "function",
                                                                "function": {"name": "get_time"}}), ToolFlags())
    assert [t.name for t in described] == ["get_weather", "get_time"] and isinstance(use.parser, NamedParser)
    assert json.loads(use.constraint.text) == Tool("x").parameters
    assert chat_tools(_body(tools=tools, tool_choice="none"), ToolFlags())[1] == ()
    with pytest.raises(ValueError, match=r"^tool_choice: a required or named tool call constrains the reply"):
        chat_tools(_body(tools=tools, tool_choice="required", response_format={"type": "json_object"}), ToolFlags())


def test_a_conversation_with_calls_and_results_is_checked_by_field():
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    prompt = chat_prompt(_body(messages=[{"role": "user", "content": "time?"},
                                         {"role": "assistant", "content": None, "tool_calls": [call]},
                                         {"role": "tool", "tool_call_id": "c1", "content": "noon"}]))
    assert prompt.messages[1].openai()["tool_calls"][0]["function"] == call["function"]
    assert prompt.messages[2].openai() == {"role": "tool", "content": "noon", "tool_call_id": "c1"}
    with pytest.raises(ValueError, match=r"^messages\.0\.tool_call_id: a tool message must name the call"):
        chat_prompt(_body(messages=[{"role": "tool", "content": "noon"}]))
    with pytest.raises(ValueError, match=r"^messages\.0\.tool_calls: only an assistant message"):
        chat_prompt(_body(messages=[{"role": "user", "content": "x", "tool_calls": [call]}]))
