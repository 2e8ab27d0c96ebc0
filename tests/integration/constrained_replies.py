"""Checks of constrained replies that several meshes run (the disaggregated pool, a speculating
decode worker, colocated workers): every reply must match what was asked for."""

from __future__ import annotations

import json
import re

import jsonschema
import openai

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "population": {"type": "integer"},
                                         "country": {"enum": ["France", "Italy", "Spain"]}},
        "required": ["name", "population", "country"], "additionalProperties": False}
PROMPT = "The three largest cities of France, as JSON:"
CHAT = [{"role": "user", "content": "Describe the largest city of Italy as JSON."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A structural tag: free text in which "<city>" opens a record that must match CITY, then "</city>".
TAG = {"structures": [{"begin": "<city>", "schema": CITY, "end": "</city>"}], "triggers": ["<city>"]}
# A completion prompt whose greedy continuation writes tagged records (so the tag's grammar is used).
TAGGED = ('<city>{"name": "Rome", "population": 2800000, "country": "Italy"}</city>\n'
          '<city>{"name": "Madrid", "population": 3300000, "country": "Spain"}</city>\n')
# vLLM's structured_outputs kinds and how to tell that a reply matches each.
KINDS = {
    "regex": ({"regex": r"[0-9]{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
    "choice": ({"choice": ["Paris", "Lyon", "Marseille"]}, lambda t: t in ("Paris", "Lyon", "Marseille")),
    "grammar": ({"grammar": 'start: "Answer: " ("yes" | "no")'}, lambda t: t in ("Answer: yes", "Answer: no")),
    "json_object": ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
}


def check_json_schema_replies(client: openai.OpenAI, model: str) -> None:
    """`response_format` json_schema at temperatures 0 and 1, two choices each: every reply validates."""
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=80, temperature=temperature, n=2, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), CITY)


def check_structured_output_kinds(client: openai.OpenAI, model: str) -> None:
    """Each of vLLM's `structured_outputs` kinds, greedy and (but any JSON object) at temperature 1."""
    for name, (constraint, matches) in KINDS.items():
        # Any JSON object at temperature 1 may run past max_tokens: greedy only.
        for temperature in (0.0,) if name == "json_object" else (0.0, 1.0):
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=60, temperature=temperature,
                                              seed=3, extra_body={"structured_outputs": constraint})
            text = reply.choices[0].text
            assert reply.choices[0].finish_reason == "stop" and matches(text), (name, temperature, text)


def tagged_records(text: str, cut: bool) -> int:
    """How many tagged records `text` holds, each validated against CITY; AssertionError if one is
    left open but the last where the reply was `cut` by max_tokens (a structure begun must end)."""
    bodies = re.findall(r"<city>(.*?)</city>", text, flags=re.S)
    for body in bodies:
        jsonschema.validate(json.loads(body), CITY)
    assert text.count("<city>") - len(bodies) in ((0, 1) if cut else (0,)), text
    return len(bodies)


def check_structural_tags(client: openai.OpenAI, model: str) -> None:
    """vLLM's `structural_tag`: the records the model writes after each trigger all validate, at
    temperatures 0 and 1 (greedy, it writes at least one)."""
    constraint = {"structural_tag": json.dumps(TAG)}
    for temperature in (0.0, 1.0):
        reply = client.completions.create(model=model, prompt=TAGGED, max_tokens=60, temperature=temperature, seed=3,
                                          extra_body={"structured_outputs": constraint})
        choice = reply.choices[0]
        records = tagged_records(choice.text, cut=choice.finish_reason == "length")
        assert records >= 1 or temperature == 1.0, choice.text


def check_forced_tool_calls(client: openai.OpenAI, model: str) -> None:
    """`tool_choice` required and named, temperatures 0 and 1, two choices each: every reply is
    calls of the tools (the named one where named) whose arguments parse and validate."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        for temperature in (0.0, 1.0):
            reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=60, temperature=temperature, n=2, seed=5)
            for answer in reply.choices:
                # A named function's reply finishes "stop", as OpenAI's and vLLM's do.
                assert answer.finish_reason == ("tool_calls" if choice == "required" else "stop"), answer
                assert answer.message.tool_calls, answer
                for call in answer.message.tool_calls:
                    assert call.id.startswith("chatcmpl-tool-") and (choice == "required" or call.function.name ==
                                                                     "get_time"), call
                    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
