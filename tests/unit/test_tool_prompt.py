"""Tools in the chat prompt: a template with a tools section renders them as transformers renders
it; SmolLM2's, which has none, gets the conversation rewritten in the default (Hermes) tool format."""

from __future__ import annotations

import json

from engine.chat_template import ChatTemplate
from engine.tokenizer import Tokenizer
from services.gateway.tools.parsers import HermesParser

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
# A template of the kind recent models ship, with its own tools section.
WITH_TOOLS = (
    "{% if tools %}<|system|>Tools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}"
    "{% for call in message.tool_calls or [] %}[call {{ call.function.name }} {{ call.function.arguments | tojson }} "
    "city={{ call.function.arguments.city }}]{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_template_with_a_tools_section_renders_them_as_transformers_does(reference_tokenizer):
    ours = ChatTemplate(WITH_TOOLS, {})
    assert ours.has_tools
    # transformers hands the template what it is given: the arguments parsed, as templates expect them.
    parsed = [*CONVERSATION[:1], {**CONVERSATION[1], "tool_calls": [
        {**CALL, "function": {**CALL["function"], "arguments": {"city": "Paris"}}}]}, CONVERSATION[2]]
    expected = reference_tokenizer.apply_chat_template(parsed, tools=TOOLS, chat_template=WITH_TOOLS, tokenize=False,
                                                       add_generation_prompt=True)
    assert ours.render(CONVERSATION, tools=TOOLS) == expected
    assert "city=Paris" in expected and "get_weather" in expected.split("<|user|>")[0]


def test_a_template_without_tools_gets_the_default_tool_prompt(tokenizer: Tokenizer):
    plain = tokenizer.apply_chat_template(CONVERSATION[:1])
    assert "get_weather" not in plain
    rendered = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS)
    system, rest = rendered.split("<|im_end|>", 1)
    assert system.startswith("<|im_start|>system\n") and "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in system
    assistant = rest.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    # The assistant's earlier call is written as the hermes parser reads calls back.
    [call] = HermesParser().read(assistant, final=True).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in rendered
    with_system = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *CONVERSATION],
                                                tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model.")


def test_a_chat_template_given_replaces_the_models(tokenizer: Tokenizer):
    replaced = tokenizer.with_chat_template(WITH_TOOLS)
    assert replaced.apply_chat_template(CONVERSATION[:1]) == "<|user|>Weather in Paris?<|assistant|>"
    assert tokenizer.apply_chat_template(CONVERSATION[:1]).startswith("<|im_start|>system")
