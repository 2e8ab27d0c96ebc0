"""The OpenAI-compatible API's request bodies -> the gateway core's requests, and failures -> error bodies."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from services.common.errors import StatusError
from services.gateway.openai_api.errors import api_error
from services.gateway.openai_api.params import (
    COMPLETION_MAX_TOKENS,
    chat_prompt,
    chat_requests,
    completion_prompts,
    completion_requests,
    echoed_prompts,
    prediction_text,
    sampling_params,
    unknown_fields,
)
from services.gateway.openai_api.schema import ChatBody, CompletionBody
from services.gateway.request import ChatMessage, ChatPrompt, CheckedPrompt, RequestedSlo, TextPrompt, TokenPrompt

ONE = CheckedPrompt((1,))  # a prompt the served model tokenized and checked


def completion(**fields) -> CompletionBody:
    return CompletionBody.model_validate({"prompt": "hi", **fields})


def chat(**fields) -> ChatBody:
    return ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_an_empty_body_means_the_engine_defaults_and_sixteen_tokens():
    [request] = completion_requests(completion(), [CheckedPrompt((1, 2))], "cmpl-1")
    assert request.sampling == SamplingParams(max_tokens=COMPLETION_MAX_TOKENS)
    assert request.prompt == CheckedPrompt((1, 2))
    assert (request.model, request.request_id, request.slo, request.priority) == ("", "cmpl-1-0", RequestedSlo(), 0)


def test_every_sampling_field_and_vllm_extension_reaches_the_engine():
    body = completion(max_tokens=9, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.2,
                      presence_penalty=0.5, frequency_penalty=-0.5, seed=3, stop="\n", stop_token_ids=[7],
                      ignore_eos=True, min_tokens=2, skip_special_tokens=False, logprobs=4)
    [request] = completion_requests(body, [ONE], "r")
    assert request.sampling == SamplingParams(
        max_tokens=9, min_tokens=2, temperature=0.5, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=3, stop=("\n",), stop_token_ids=(7,), ignore_eos=True,
        logprobs=4, skip_special_tokens=False,
    )


def test_slo_and_priority_fields_reach_the_request():
    [request] = completion_requests(completion(ttft_ms=800, tpot_ms=40, priority=5, model="m"), [ONE], "r")
    assert (request.slo, request.priority, request.model) == (RequestedSlo(800, 40), 5, "m")


def test_n_fans_out_with_consecutive_seeds_prompt_major():
    requests = completion_requests(completion(n=2, seed=10, prompt=["a", "b"]), [ONE, CheckedPrompt((2,))], "r")
    assert [(r.prompt.ids, r.sampling.seed, r.request_id) for r in requests] == [
        ((1,), 10, "r-0"), ((1,), 11, "r-1"), ((2,), 10, "r-2"), ((2,), 11, "r-3")]
    unseeded = completion_requests(completion(n=3), [ONE], "r")
    assert [r.sampling.seed for r in unseeded] == [None, None, None]


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", [TextPrompt("text")]),
    ([5, 6], [TokenPrompt((5, 6))]),
    (["a", "b"], [TextPrompt("a"), TextPrompt("b")]),
    ([[1], [2, 3]], [TokenPrompt((1,)), TokenPrompt((2, 3))]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion_prompts(completion(prompt=prompt)) == expected


def test_an_empty_or_too_large_batch_is_refused():
    with pytest.raises(ValueError, match=r"^prompt: must not be empty"):
        completion_prompts(completion(prompt=[]))
    with pytest.raises(ValueError, match=r"^prompt: 40 prompts times n=2 exceeds 64"):
        completion_prompts(completion(prompt=["x"] * 40, n=2))


def test_chat_content_may_be_text_parts_but_nothing_else():
    body = chat(messages=[{"role": "system", "content": None},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert chat_prompt(body) == ChatPrompt((ChatMessage("system", ""), ChatMessage("user", "ab")))
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match=r"^messages\.0\.content: only text parts"):
        chat_prompt(image)


def test_chat_max_tokens_default_to_the_rest_of_the_context():
    [request] = chat_requests(chat(), CheckedPrompt((1,) * 100), 1000, "r")
    assert request.sampling.max_tokens == 900
    [request] = chat_requests(chat(max_tokens=5, max_completion_tokens=7), ONE, 1000, "r")
    assert request.sampling.max_tokens == 7


def test_chat_logprobs_are_a_flag_with_a_count_of_alternatives():
    assert chat_requests(chat(), ONE, 100, "r")[0].sampling.logprobs is None
    assert chat_requests(chat(logprobs=True), ONE, 100, "r")[0].sampling.logprobs == 0
    assert chat_requests(chat(logprobs=True, top_logprobs=3), ONE, 100, "r")[0].sampling.logprobs == 3
    with pytest.raises(ValueError, match=r"^top_logprobs: requires logprobs"):
        chat_requests(chat(top_logprobs=3), ONE, 100, "r")


def test_logit_bias_reaches_the_engine_and_bad_entries_name_the_field():
    assert sampling_params(completion(logit_bias={"7": 5, "3": -100}), 4, None, None).logit_bias == (
        (3, -100.0), (7, 5.0))
    with pytest.raises(ValueError, match=r"^logit_bias: 'x' is not a token id"):
        sampling_params(completion(logit_bias={"x": 1}), 4, None, None)
    with pytest.raises(ValueError, match=r"^logit_bias: the bias of token 7 must be in \[-100, 100\]"):
        sampling_params(completion(logit_bias={"7": 101}), 4, None, None)


def test_echo_gives_each_choice_its_prompt_text_and_is_refused_with_logprobs():
    body = completion(echo=True, n=2, prompt=["ab", "cd"])
    assert echoed_prompts(body, completion_prompts(body), str) == ["ab", "ab", "cd", "cd"]
    tokens = completion(echo=True, prompt=[[5, 6]])
    assert echoed_prompts(tokens, completion_prompts(tokens), lambda ids: f"<{ids[0]}>") == ["<5>"]
    plain = completion(n=2)
    assert echoed_prompts(plain, completion_prompts(plain), str) == ["", ""]
    with pytest.raises(ValueError, match=r"^echo: with logprobs"):
        completion_requests(completion(echo=True, logprobs=1), [ONE], "r")


def test_a_prediction_is_its_text_and_reaches_the_engine_as_tokens():
    assert prediction_text(chat()) == ""
    assert prediction_text(chat(prediction={"type": "content", "content": "abc"})) == "abc"
    parts = {"type": "content", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}
    assert prediction_text(chat(prediction=parts)) == "abc"
    with pytest.raises(ValueError, match=r"^prediction\.content\.0: only text"):
        prediction_text(chat(prediction={"type": "content", "content": [{"type": "image_url"}]}))
    [request] = chat_requests(chat(max_tokens=4), ONE, 100, "r", [7, 8])
    assert request.sampling.prediction == (7, 8)
    with pytest.raises(ValueError, match=r"^prediction: 3 tokens"):
        chat_requests(chat(), ONE, 2, "r", [1, 2, 3])


def test_a_cache_salt_reaches_the_engine_and_a_bad_one_names_the_field():
    [request] = chat_requests(chat(cache_salt="tenant-a"), ONE, 100, "r")
    assert request.sampling.cache_salt == "tenant-a"
    [request] = completion_requests(completion(), [ONE], "r")
    assert request.sampling.cache_salt == ""
    for bad in ("", 7, ["a"]):
        for body in (completion, chat):
            with pytest.raises(ValidationError) as refused:
                body(cache_salt=bad)
            assert [error["loc"] for error in refused.value.errors()] == [("cache_salt",)]


def test_engine_limits_name_the_body_field():
    with pytest.raises(ValueError, match=r"^temperature: must be in \[0, 100\]"):
        sampling_params(completion(temperature=101), 4, None, None)
    with pytest.raises(ValueError, match=r"^seed:"):
        completion_requests(completion(n=2, seed=2**63 - 1), [ONE], "r")


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                                 "strict": True}}},
     StructuredOutput("json", '{"type": "object"}')),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput.choice(["a", "b"])),
    ({"structured_outputs": {"json": {"type": "integer"}, "disable_any_whitespace": True}},
     StructuredOutput("json", '{"type": "integer"}', whitespace_flexible=False)),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutput("grammar", 'start: "x"')),
])
def test_response_format_and_structured_outputs_become_the_engines_constraint(fields, expected):
    for body in (completion(**fields), chat(**fields)):
        assert sampling_params(body, 4, None, None).structured == expected


def test_unknown_fields_are_listed_known_ones_not():
    body = completion(best_of_everything=2, user="u", store=True, metadata={"k": "v"}, echo=False, best_of=1,
                      logit_bias={},
                      stream_options={"include_usage": True, "continuous": True})
    assert unknown_fields(body) == ["best_of_everything", "stream_options.continuous"]
    assert body.include_usage


@pytest.mark.parametrize(("fields", "param"), [
    ({"best_of": 2}, "best_of"),
    ({"suffix": "end"}, "suffix"), ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["audio"]}, "modalities"),
])
def test_an_openai_field_that_would_change_the_output_unserved_is_refused_by_name(fields, param):
    with pytest.raises(ValueError, match=f"^{param}: not served"):
        unknown_fields(completion(**fields))


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"), ({"max_tokens": "lots"}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"ttft_ms": 0}, "ttft_ms"), ({"stop": 3}, "stop"), ({"prompt": None}, "prompt"),
    # Past the wire's integer types (the fuzz found ttft_ms 2**32 answered "Value out of range").
    ({"ttft_ms": 2**32}, "ttft_ms"), ({"tpot_ms": 2**32}, "tpot_ms"), ({"priority": 2**31}, "priority"),
])
def test_schema_errors_are_400s_naming_the_field(fields, param):
    with pytest.raises(ValidationError) as invalid:
        completion(**fields)
    error = api_error(invalid.value)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(param)


def test_malformed_json_and_non_objects_are_400s():
    for raw in (b'{"prompt": ', b"[1]", b"null"):
        with pytest.raises(ValidationError) as invalid:
            CompletionBody.model_validate_json(raw)
        assert api_error(invalid.value).status == 400


@pytest.mark.parametrize(("code", "status", "type_"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "BadRequestError"),
    (grpc.StatusCode.NOT_FOUND, 404, "NotFoundError"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "RateLimitError"),
    (grpc.StatusCode.UNAVAILABLE, 503, "ServiceUnavailableError"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "TimeoutError"),
    (grpc.StatusCode.INTERNAL, 500, "InternalServerError"),
])
def test_core_status_codes_become_vllm_http_statuses(code, status, type_):
    error = api_error(StatusError(code, "max_tokens: too many"))
    assert (error.status, error.type, error.param) == (status, type_, "max_tokens")
    assert error.body() == {"error": {"message": "max_tokens: too many", "type": type_, "param": "max_tokens",
                                      "code": status}}
    response = error.response()
    assert response.status_code == status
    assert ("retry-after" in response.headers) == (status == 429)


def test_a_value_error_is_a_400_and_anything_else_a_500():
    assert api_error(ValueError("top_k: must be -1, 0 or positive")).status == 400
    assert api_error(RuntimeError("boom")).status == 500
