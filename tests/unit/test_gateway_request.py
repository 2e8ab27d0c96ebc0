"""tandem.v1.GenerateRequest -> the gateway core's request (the gRPC edge), tools included."""

from __future__ import annotations

import pytest
from tandem.v1 import common_pb2, gateway_pb2

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from services.gateway.handler import generate_request_from_proto
from services.gateway.request import ChatMessage, ChatPrompt, RequestedSlo, TextPrompt, TokenPrompt, ToolCall
from services.gateway.tools.choice import Tool, ToolFlags
from services.gateway.tools.parsers import HermesParser, NamedParser

WEATHER = '{"type": "object", "properties": {"city": {"type": "string"}}}'


def test_every_field_is_carried():
    msg = gateway_pb2.GenerateRequest(
        request_id="r1", model="m", text="hello",
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.0, top_k=3),
        slo=common_pb2.Slo(ttft_ms=500, tpot_ms=50), priority=-2,
    )
    request, _ = generate_request_from_proto(msg)
    assert request.prompt == TextPrompt("hello")
    assert request.sampling == SamplingParams(max_tokens=5, temperature=0.0, top_k=3)
    assert (request.request_id, request.model, request.slo, request.priority) == ("r1", "m", RequestedSlo(500, 50), -2)


def test_unset_slo_fields_take_the_deployment_defaults():
    request, _ = generate_request_from_proto(gateway_pb2.GenerateRequest(text="x", slo=common_pb2.Slo(tpot_ms=20)))
    assert request.slo == RequestedSlo(ttft_ms=None, tpot_ms=20)


def test_token_and_chat_prompts():
    ids = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 2]))
    assert generate_request_from_proto(ids)[0].prompt == TokenPrompt((1, 2))
    chat = gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role="user", content="hi")]))
    assert generate_request_from_proto(chat)[0].prompt == ChatPrompt((ChatMessage("user", "hi"),))


def test_bad_requests_name_the_field():
    with pytest.raises(ValueError, match=r"^prompt: must be set"):
        generate_request_from_proto(gateway_pb2.GenerateRequest())
    bad = gateway_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match=r"^sampling\.top_p: "):
        generate_request_from_proto(bad)


def _with_tools(**fields) -> gateway_pb2.GenerateRequest:
    call = gateway_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Rome"}')
    return gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(role="assistant", content="", tool_calls=[call]),
        gateway_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="c1")]),
        tools=[gateway_pb2.Tool(name="get_weather", description="weather", parameters_json=WEATHER),
               gateway_pb2.Tool(name="get_time")], **fields)


def test_tools_calls_and_a_named_choice_are_carried():
    request, use = generate_request_from_proto(_with_tools(tool_choice=gateway_pb2.ToolChoice(function="get_weather")))
    assert request.prompt.messages[0].tool_calls == (ToolCall("c1", "get_weather", '{"city": "Rome"}'),)
    assert request.prompt.messages[1].tool_call_id == "c1"
    assert [tool.name for tool in request.prompt.tools] == ["get_weather", "get_time"]
    assert request.prompt.tools[1] == Tool("get_time")
    assert isinstance(use.parser, NamedParser)
    assert request.sampling.structured == StructuredOutput("json", WEATHER, whitespace_flexible=False)
    auto = ToolFlags(enable_auto_tool_choice=True, tool_call_parser="hermes")
    request, use = generate_request_from_proto(_with_tools(), tool_flags=auto)
    assert isinstance(use.parser, HermesParser) and request.sampling.structured is None
    request, use = generate_request_from_proto(_with_tools(tool_choice=gateway_pb2.ToolChoice(mode="none")))
    assert use.parser is None and request.prompt.tools == ()


@pytest.mark.parametrize(("fields", "message"), [
    ({}, r"^tool_choice: .*--enable-auto-tool-choice"),
    ({"tool_choice": gateway_pb2.ToolChoice(mode="sometimes")}, r"^tool_choice\.mode: 'sometimes' is none of"),
    ({"tool_choice": gateway_pb2.ToolChoice(mode="required"),
      "sampling": common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(regex="a"))},
     r"^tool_choice: a required or named tool call constrains"),
])
def test_bad_tool_requests_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        generate_request_from_proto(_with_tools(**fields))
    text = gateway_pb2.GenerateRequest(text="x", tools=[gateway_pb2.Tool(name="f")])
    with pytest.raises(ValueError, match=r"^tools: only a chat prompt"):
        generate_request_from_proto(text)
    bad = _with_tools()
    bad.tools[0].parameters_json = "{"
    with pytest.raises(ValueError, match=r"^tools\.0\.parameters_json: not JSON"):
        generate_request_from_proto(bad)
