"""Structured outputs through the mesh with the official `openai` SDK: OpenAI's `response_format`
and vLLM's `structured_outputs` across the prefill-decode split (the prefill worker samples the
first token under the grammar, the decode worker rebuilds it from that token), on a plain and on a
speculating decode worker (the shared pool's decode[1]); constrained greedy output equals an
in-process engine's; bad specs are 400s naming the field. Colocated workers:
tests/integration/test_routing.py."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from constrained_replies import (
    CHAT,
    CITY,
    PROMPT,
    check_json_schema_replies,
    check_structural_tags,
    check_structured_output_kinds,
)
from engine_runs import output_tokens, run_requests
from shared_pool import Pool, pair_gateways

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput


class City(pydantic.BaseModel):
    name: str
    population: int
    country: str


@pytest.fixture(scope="module")
def gateways(pool: Pool):
    """(plain, speculating): each pairs a prefill worker with one decode worker of the pool."""
    with pair_gateways(pool) as processes:
        yield processes


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "speculating"])
def test_every_json_schema_reply_validates_at_both_temperatures(clients, model_id, which):
    check_json_schema_replies(clients[which], model_id)


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "speculating"])
def test_vllm_structured_outputs_kinds_through_the_split(clients, model_id, which):
    check_structured_output_kinds(clients[which], model_id)
    check_structural_tags(clients[which], model_id)


def test_constrained_greedy_output_is_the_in_process_engines(clients, model_id, make_engine, tokenizer):
    spec = StructuredOutput("json", json.dumps(CITY))
    engine = make_engine()
    expected = output_tokens(run_requests(engine, {"r": (tokenizer.encode(PROMPT), SamplingParams(
        max_tokens=60, temperature=0.0, structured=spec))})["r"])
    for client in clients:
        reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=60, temperature=0.0,
                                          logprobs=0, extra_body={"structured_outputs": {"json": CITY}})
        assert reply.choices[0].text == tokenizer.decode(expected)


def test_the_sdks_parse_returns_the_model_object(clients, model_id):
    completion = clients[0].chat.completions.parse(model=model_id, messages=CHAT, max_tokens=80, temperature=0.0,
                                                   response_format=City)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern",
     "not served"),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be set"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(clients, model_id, body, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        clients[0].completions.create(model=model_id, prompt=PROMPT, max_tokens=8, extra_body=body)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error
