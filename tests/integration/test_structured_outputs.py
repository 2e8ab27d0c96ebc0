"""Structured outputs through the mesh with the official `openai` SDK: OpenAI's `response_format`
and vLLM's `structured_outputs` across the prefill-decode split (the prefill worker samples the
first token under the grammar, the decode worker rebuilds it from that token), on a plain and on a
speculating decode worker (the shared pool's decode[1]); constrained greedy output equals an
in-process engine's; bad specs are 400s naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest
from engine_runs import output_tokens, run_requests
from shared_pool import NO_SLO, Pool

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from harness.worker import WorkerProcess, start_worker

TIMEOUT_S = 300.0
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "population": {"type": "integer"},
                                         "country": {"enum": ["France", "Italy", "Spain"]}},
        "required": ["name", "population", "country"], "additionalProperties": False}
PROMPT = "The three largest cities of France, as JSON:"
CHAT = [{"role": "user", "content": "Describe the largest city of Italy as JSON."}]


class City(pydantic.BaseModel):
    name: str
    population: int
    country: str


@pytest.fixture(scope="module")
def gateways(pool: Pool):
    """(plain, speculating): each pairs a prefill worker with one decode worker of the pool."""
    args = [["gateway", "--port", "0", "--http-port", "0", "--prefill", str(pool.prefill[i].address),
             "--decode", str(pool.decode[i].address), *NO_SLO] for i in (0, 1)]
    processes = [start_worker(a, wait=False) for a in args]
    try:
        for process in processes:
            process.wait_ready()
        yield processes
    finally:
        assert [process.stop() for process in processes] == [0, 0]


def _client(gateway: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gateway.http_address}/v1", api_key="unused", max_retries=0,
                         timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def clients(gateways) -> list[openai.OpenAI]:
    return [_client(gateway) for gateway in gateways]


@pytest.fixture(scope="module")
def model_id(clients) -> str:
    return clients[0].models.list().data[0].id


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "speculating"])
def test_every_json_schema_reply_validates_at_both_temperatures(clients, model_id, which):
    client = clients[which]
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model=model_id, messages=CHAT, max_tokens=80, temperature=temperature, n=2, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), CITY)


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "speculating"])
def test_vllm_structured_outputs_kinds_through_the_split(clients, model_id, which):
    client = clients[which]
    kinds = {
        "regex": ({"regex": r"[0-9]{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
        "choice": ({"choice": ["Paris", "Lyon", "Marseille"]}, lambda t: t in ("Paris", "Lyon", "Marseille")),
        "grammar": ({"grammar": 'start: "Answer: " ("yes" | "no")'}, lambda t: t in ("Answer: yes", "Answer: no")),
        "json_object": ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    }
    for name, (constraint, matches) in kinds.items():
        # Any JSON object at temperature 1 may run past max_tokens: greedy only.
        for temperature in (0.0,) if name == "json_object" else (0.0, 1.0):
            reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=60, temperature=temperature,
                                              seed=3, extra_body={"structured_outputs": constraint})
            text = reply.choices[0].text
            assert reply.choices[0].finish_reason == "stop" and matches(text), (name, temperature, text)


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
