"""tandem.v1.GenerateRequest -> the gateway core's request (the gRPC edge)."""

from __future__ import annotations

import pytest
from tandem.v1 import common_pb2, gateway_pb2

from engine.sampling_params import SamplingParams
from services.gateway.handler import generate_request_from_proto
from services.gateway.request import ChatMessage, ChatPrompt, RequestedSlo, TextPrompt, TokenPrompt


def test_every_field_is_carried():
    msg = gateway_pb2.GenerateRequest(
        request_id="r1", model="m", text="hello",
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.0, top_k=3),
        slo=common_pb2.Slo(ttft_ms=500, tpot_ms=50), priority=-2,
    )
    request = generate_request_from_proto(msg)
    assert request.prompt == TextPrompt("hello")
    assert request.sampling == SamplingParams(max_tokens=5, temperature=0.0, top_k=3)
    assert (request.request_id, request.model, request.slo, request.priority) == ("r1", "m", RequestedSlo(500, 50), -2)


def test_unset_slo_fields_take_the_deployment_defaults():
    request = generate_request_from_proto(gateway_pb2.GenerateRequest(text="x", slo=common_pb2.Slo(tpot_ms=20)))
    assert request.slo == RequestedSlo(ttft_ms=None, tpot_ms=20)


def test_token_and_chat_prompts():
    ids = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 2]))
    assert generate_request_from_proto(ids).prompt == TokenPrompt((1, 2))
    chat = gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role="user", content="hi")]))
    assert generate_request_from_proto(chat).prompt == ChatPrompt((ChatMessage("user", "hi"),))


def test_bad_requests_name_the_field():
    with pytest.raises(ValueError, match=r"^prompt: must be set"):
        generate_request_from_proto(gateway_pb2.GenerateRequest())
    bad = gateway_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match=r"^sampling\.top_p: "):
        generate_request_from_proto(bad)
