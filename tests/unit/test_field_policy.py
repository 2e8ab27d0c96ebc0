"""Every request field of the pinned `openai` SDK's `chat.completions.create` and `completions.create`
is honoured (a field of the API's body schema), a listed no-op, or refused while it would change the
output (services.gateway.openai_api.field_policy): none is silently ignored."""

from __future__ import annotations

import inspect

import openai
import pytest

from services.gateway.openai_api.field_policy import NO_OPS, REFUSED
from services.gateway.openai_api.schema import ChatBody, CompletionBody

CLIENT_ONLY = {"extra_headers", "extra_query", "extra_body", "timeout"}  # the SDK's, not the API's


def _declared(body: type) -> set[str]:
    return {field.alias or name for name, field in body.model_fields.items()}


@pytest.mark.parametrize(("method", "body"), [("chat", ChatBody), ("completions", CompletionBody)])
def test_every_sdk_parameter_is_honoured_a_no_op_or_refused(method, body):
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    create = client.chat.completions.create if method == "chat" else client.completions.create
    parameters = set(inspect.signature(create).parameters) - CLIENT_ONLY
    honoured = _declared(body)
    unclassified = sorted(parameters - honoured - NO_OPS - REFUSED.keys())
    assert not unclassified, f"{method}: decide for each whether it is served, a no-op or refused: {unclassified}"
    # A field is in one class only: a served one is never refused or dropped as a no-op.
    assert not honoured & (NO_OPS | REFUSED.keys())
