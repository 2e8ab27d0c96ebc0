"""Tool calling through the disaggregated mesh with the official `openai` SDK: calls forced by
`required` or a named function (constrained by the tools' schemas) on a plain and a speculating
decode worker, calls parsed from the model's text for `auto` (the hermes parser), streamed deltas
that reassemble into the non-streamed reply, a conversation carrying calls and their results, 400s
naming the field, the gRPC API's calls and the SDK's `parse` of a function tool. Colocated workers:
tests/integration/test_routing.py."""

from __future__ import annotations

import json

import grpc
import openai
import pydantic
import pytest
from constrained_replies import ASK, TOOLS, check_forced_tool_calls
from shared_pool import Pool, pair_gateways
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

TIMEOUT_S = 300.0
AUTO_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _one_shot(city: str) -> list[dict]:
    """A conversation in which the assistant answered a weather question with a call, then the question
    about `city`: the 135M model then writes a call of its own, in the default prompt's format."""
    call = {"id": "c0", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": json.dumps({"city": "Rome"})}}
    return [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.fixture(scope="module")
def gateways(pool: Pool):
    """(auto, plain): the first serves tool_choice auto, in front of the plain decode worker; the
    second, in front of the speculating one, does not."""
    with pair_gateways(pool, AUTO_FLAGS) as processes:
        yield processes


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "speculating"])
def test_required_and_named_calls_always_parse_and_validate(clients, model_id, which):
    check_forced_tool_calls(clients[which], model_id)


def test_auto_calls_are_parsed_from_the_models_text(clients, model_id):
    for city in ("Paris", "Berlin", "Tokyo"):
        reply = clients[0].chat.completions.create(model=model_id, messages=_one_shot(city), tools=TOOLS,
                                                   max_tokens=60, temperature=0.0)
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
        [call] = answer.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
    # Without a call in its text, a reply under auto is plain content.
    reply = clients[0].chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, max_tokens=12,
                                               temperature=0.0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def _streamed(client: openai.OpenAI, **request) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                if call.id is not None:
                    assert call.index == len(calls) and call.function.name
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(call) for _, call in sorted(calls.items())], finish


@pytest.mark.parametrize("case", ["required", "named", "auto"])
def test_streamed_deltas_reassemble_into_the_reply(clients, model_id, case):
    choice = {"required": "required", "named": NAMED, "auto": "auto"}[case]
    request = {"model": model_id, "messages": _one_shot("Paris") if case == "auto" else ASK, "tools": TOOLS,
               "tool_choice": choice, "max_tokens": 60, "temperature": 0.0}
    whole = clients[0].chat.completions.create(**request).choices[0]
    calls = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls]
    assert _streamed(clients[0], **request) == (whole.message.content, calls, whole.finish_reason) and calls


def test_a_conversation_with_calls_and_their_results_is_answered(clients, model_id):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 degrees, sunny"}]
    reply = clients[1].chat.completions.create(model=model_id, messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=16, temperature=0.0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("which", "fields", "param", "words"), [
    (1, {"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    (1, {}, "tool_choice", "--enable-auto-tool-choice"),  # auto is the default with tools
    (0, {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "no tool is named"),
    (0, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters", "not a JSON schema"),
    (0, {"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "constrains"),
    (0, {"messages": [{"role": "tool", "content": "18"}]}, "messages.0.tool_call_id", "must name the call"),
])
def test_bad_tool_requests_are_400s_naming_the_field(clients, model_id, which, fields, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        clients[which].chat.completions.create(**{"model": model_id, "messages": ASK, "tools": TOOLS,
                                                  "max_tokens": 8, **fields})
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error


def test_the_grpc_api_serves_the_same_calls(gateways, clients, model_id):
    """A named call over tandem.v1.Gateway: the last response carries the call read from the same
    greedy text the HTTP API answers with."""
    whole = clients[0].chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                               max_tokens=60, temperature=0.0).choices[0].message.tool_calls[0]
    request = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=ASK[0]["content"])]),
        tools=[gateway_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"],
                                parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS],
        tool_choice=gateway_pb2.ToolChoice(function="get_time"),
        sampling=common_pb2.SamplingParams(max_tokens=60, temperature=0.0))
    with grpc.insecure_channel(str(gateways[0].address)) as channel:
        responses = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=TIMEOUT_S))
    [call] = responses[-1].tool_calls
    assert (call.name, call.arguments) == ("get_time", whole.function.arguments)
    assert "".join(r.chunk.text for r in responses) == whole.function.arguments
    assert not any(r.tool_calls for r in responses[:-1])


class GetTime(pydantic.BaseModel):
    """Local time of a city."""

    city: str = pydantic.Field(max_length=20)


def test_the_sdks_parse_returns_tool_arguments_as_the_model_object(clients, model_id):
    completion = clients[0].chat.completions.parse(
        model=model_id, messages=ASK, max_tokens=40, temperature=0.0, tools=[openai.pydantic_function_tool(GetTime)],
        tool_choice={"type": "function", "function": {"name": "GetTime"}})
    [call] = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetTime) and call.function.parsed_arguments.city
