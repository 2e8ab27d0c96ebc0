"""The gateway's OpenAI-compatible HTTP API through the official `openai` SDK, against a real mesh
(gateway, prefill and decode processes on loopback); greedy output is compared with the gRPC API's.
Its WebSocket endpoints through a real WebSocket client (`websocket-client`), against the SSE stream."""

from __future__ import annotations

import http.client
import json
import struct
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import openai
import pytest
import websocket
from parity_prompts import travel_diary
from shared_pool import Pool, worker_args
from tandem.v1 import common_pb2, decode_pb2_grpc

from harness.leak_check import load_report
from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker
from services.client import TandemClient
from services.common.server import channel_options
from services.gateway.formats import FORMAT_FIELDS

TIMEOUT_S = 300.0
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the boiling point of water at sea level?"}]
GREEDY = {"max_tokens": 24, "temperature": 0.0}
DEADLINE_S = 60.0  # generous bound for conditions polled below; no test asserts elapsed time


@dataclass
class Mesh:
    gateway: WorkerProcess  # over one prefill and one decode worker
    overloaded: WorkerProcess  # its only decode worker has a 4-block KV cache
    orphan: WorkerProcess  # its workers do not exist
    decode: WorkerProcess


def _worker(role: str, *flags: str) -> list[str]:
    return [role, "--port", str(free_port()), *flags]


def _gateway(prefill: list[str], decode: list[str], *flags: str) -> list[str]:
    # Objectives no request here can miss: these tests are about the API, not admission.
    return ["gateway", "--port", "0", "--http-port", "0", "--prefill", f"127.0.0.1:{prefill[2]}",
            "--decode", f"127.0.0.1:{decode[2]}", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000", *flags]


@pytest.fixture(scope="module")
def mesh(pool: Pool):
    # A prefill and a decode worker of the shared ones, in their pinned formats: the tests below compare
    # two ways of asking for the same tokens (greedy against top_k=1), and under `auto` on a CPU with
    # native bf16 the logits are bf16, where the top two often tie exactly (top-k keeps ties, greedy
    # takes the first): fp32 tests the same numbers on any CPU.
    prefill, decode = pool.prefill[0], pool.decode[0]
    # The prefill worker's formats, so that the router pairs them (it pairs only workers whose KV
    # pages mean the same): the request then meets the 4-block cache at its reservation.
    tiny = worker_args("decode", "--kv-cache-blocks", "4")
    arg_lists = [tiny, _gateway(prefill.args, decode.args), _gateway(prefill.args, tiny),
                 _gateway(_worker("prefill"), _worker("decode"), "--wait-for-workers", "0")]
    processes = [start_worker(args, wait=False) for args in arg_lists]
    try:
        for process in processes:
            process.wait_ready()
        yield Mesh(gateway=processes[1], overloaded=processes[2], orphan=processes[3], decode=decode)
    finally:
        codes = [process.stop() for process in reversed(processes)]
        assert codes == [0] * len(processes)


@pytest.fixture(scope="module")
def gateway(mesh) -> WorkerProcess:
    return mesh.gateway


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"http://{gateway.http_address}/v1", api_key="unused", max_retries=0,
                         timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def grpc_client(gateway):
    with TandemClient(str(gateway.address)) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(client) -> str:
    [model] = client.models.list().data
    return model.id


def _grpc_text(grpc_client, **request) -> tuple[str, list]:
    text, logprobs = "", []
    for chunk in grpc_client.generate(**request, timeout=TIMEOUT_S):
        text += chunk.text
        logprobs.extend(chunk.logprobs)
    return text, logprobs


def _post(gateway: WorkerProcess, path: str, data: bytes) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://{gateway.http_address}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_models_lists_the_served_model(mesh, client, grpc_client):
    [served] = grpc_client.list_models()
    [model] = client.models.list().data
    assert (model.id, model.owned_by) == (served.id, "tandem")
    assert model.model_extra["max_model_len"] == served.max_model_len
    # The formats, as the workers (all started alike) report them: whatever `auto` chose on this machine.
    report = load_report(mesh.decode)
    assert report.dtype in ("float32", "bfloat16") and report.quantization
    assert {name: model.model_extra[name] for name in FORMAT_FIELDS} == {
        name: getattr(report, name) for name in FORMAT_FIELDS}


def test_greedy_completion_matches_grpc(client, grpc_client, model_id):
    expected, _ = _grpc_text(grpc_client, prompt=PROMPT, **GREEDY)
    reply = client.completions.create(model=model_id, prompt=PROMPT, **GREEDY)
    [choice] = reply.choices
    assert choice.text == expected
    assert reply.object == "text_completion" and reply.model == model_id
    assert reply.usage.completion_tokens == len(_grpc_tokens(grpc_client, prompt=PROMPT, **GREEDY))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens > 0


def _grpc_tokens(grpc_client, **request) -> list[int]:
    return [t for chunk in grpc_client.generate(**request, timeout=TIMEOUT_S) for t in chunk.token_ids]


def test_streamed_completion_with_usage(client, grpc_client, model_id):
    expected, _ = _grpc_text(grpc_client, prompt=PROMPT, **GREEDY)
    events = list(client.completions.create(model=model_id, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *chunks, last = events
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == GREEDY["max_tokens"]


def test_stream_is_server_sent_events_ending_done(gateway, model_id):
    body = {"model": model_id, "prompt": PROMPT, "stream": True, **GREEDY}
    status, headers, raw = _post(gateway, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [block for block in raw.decode().split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events)
    assert events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(block[len("data: "):]) for block in events[:-1])


def test_greedy_chat_matches_grpc_streamed_or_not(client, grpc_client, model_id):
    expected, _ = _grpc_text(grpc_client, messages=CHAT, **GREEDY)
    reply = client.chat.completions.create(model=model_id, messages=CHAT, **GREEDY)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens > 0

    events = list(client.chat.completions.create(model=model_id, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected
    assert events[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_chat_content_parts_and_max_completion_tokens(client, grpc_client, model_id):
    expected, _ = _grpc_text(grpc_client, messages=CHAT, max_tokens=8, temperature=0.0)
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    reply = client.chat.completions.create(model=model_id, messages=parts, max_completion_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens <= 8


def test_completion_logprobs_match_grpc(client, grpc_client, model_id):
    _, expected = _grpc_text(grpc_client, prompt=PROMPT, logprobs=2, **GREEDY)
    reply = client.completions.create(model=model_id, prompt=PROMPT, logprobs=2, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(expected) == GREEDY["max_tokens"]
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    # Greedy: the sampled token is the best alternative; at most 2 alternatives (the sampled one included).
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top, key=top.get) == token
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_with_top_alternatives(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace") == entry.token
    # The tokens spell the reply, and an end-of-turn token (a special token, left out of the text) may follow.
    assert "".join(entry.token for entry in content).startswith(reply.choices[0].message.content)


def test_n_choices_with_a_seed_differ_and_repeat(client, model_id):
    request = {"model": model_id, "prompt": PROMPT, "n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 16}
    first = client.completions.create(**request)
    again = client.completions.create(**request)
    texts = [choice.text for choice in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts[0] != texts[1]
    assert texts == [choice.text for choice in sorted(again.choices, key=lambda c: c.index)]
    assert first.usage.completion_tokens == 32

    streamed = client.completions.create(**request, stream=True)
    joined = ["", ""]
    for event in streamed:
        joined[event.choices[0].index] += event.choices[0].text
    assert joined == texts


def test_stop_string_ends_the_text_before_it(client, grpc_client, model_id):
    full, _ = _grpc_text(grpc_client, prompt=PROMPT, **GREEDY)
    words = full.split()
    stop = words[len(words) // 2]
    reply = client.completions.create(model=model_id, prompt=PROMPT, stop=[stop], **GREEDY)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == full[: full.index(stop)]


def test_vllm_sampling_extensions_are_honoured(client, grpc_client, model_id):
    greedy, _ = _grpc_text(grpc_client, prompt=PROMPT, **GREEDY)
    # top_k=1 makes sampling at temperature 1 greedy; ignore_eos runs to max_tokens.
    reply = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=GREEDY["max_tokens"], temperature=1.0,
        extra_body={"top_k": 1, "ignore_eos": True, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 4,
                    "skip_special_tokens": True, "ttft_ms": 5000, "tpot_ms": 500, "priority": 1},
    )
    assert reply.choices[0].text == greedy
    assert reply.usage.completion_tokens == GREEDY["max_tokens"]


def test_logit_bias_steers_the_tokens(client, model_id, tokenizer):
    [equals] = tokenizer.encode("=", add_special_tokens=False)
    pushed = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=3, temperature=0.0,
                                       logit_bias={str(equals): 100})
    assert pushed.choices[0].text == "==="
    greedy = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=1, temperature=0.0)
    first = tokenizer.encode(greedy.choices[0].text, add_special_tokens=False)[0]
    avoided = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=1, temperature=0.0,
                                        logit_bias={str(first): -100})
    assert avoided.choices[0].text != greedy.choices[0].text


def test_echo_returns_the_prompt_before_the_completion_streamed_or_not(client, model_id):
    plain = client.completions.create(model=model_id, prompt=PROMPT, **GREEDY)
    echoed = client.completions.create(model=model_id, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    stream = client.completions.create(model=model_id, prompt=PROMPT, echo=True, stream=True, **GREEDY)
    texts = [event.choices[0].text for event in stream if event.choices]
    assert texts[0].startswith(PROMPT) and "".join(texts) == echoed.choices[0].text


def test_a_prediction_changes_the_speed_only(client, model_id):
    plain = client.chat.completions.create(model=model_id, messages=CHAT, **GREEDY)
    text = plain.choices[0].message.content
    predicted = client.chat.completions.create(model=model_id, messages=CHAT, **GREEDY,
                                               prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text


def test_unknown_fields_are_ignored(client, model_id):
    reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2,
                                      extra_body={"no_such_field": {"x": 1}, "best_of_everything": True})
    assert reply.usage.completion_tokens == 2


def test_openai_fields_that_change_nothing_here_are_accepted_and_unserved_ones_refused(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=2, store=True,
                                           metadata={"team": "a"}, service_tier="auto", prompt_cache_key="k",
                                           tool_choice="none", parallel_tool_calls=False)
    assert reply.usage.completion_tokens == 2
    # The deprecated function-calling fields (tools replace them) are refused, never ignored.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=2, functions=[{"name": "f"}])
    assert refused.value.body["param"] == "functions" and "not served" in refused.value.body["message"]


@pytest.mark.parametrize(("request_fields", "param", "words"), [
    ({"temperature": -1.0}, "temperature", "[0, 100]"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"extra_body": {"top_k": "many"}}, "top_k", "integer"),
    ({"extra_body": {"min_tokens": 50}, "max_tokens": 10}, "min_tokens", "max_tokens=10"),
    ({"logprobs": 21}, "logprobs", "20"),
    ({"max_tokens": 10_000}, "max_tokens", "max_model_len"),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
    ({"best_of": 2}, "best_of", "not served"),
    ({"logit_bias": {"49152": 10}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
])
def test_a_bad_value_is_a_400_naming_the_field(client, model_id, request_fields, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_id, prompt=PROMPT, **{"max_tokens": 4, **request_fields})
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == param and error["code"] == 400
    assert words in error["message"], error["message"]


def test_chat_errors(client, model_id):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_id, messages=[], max_tokens=4)
    assert refused.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_id, messages=CHAT, top_logprobs=2, max_tokens=4)
    assert refused.value.body["param"] == "top_logprobs"


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert refused.value.body["param"] == "model" and "no-such-model" in refused.value.body["message"]


def test_malformed_json_is_a_400(gateway):
    for data in (b'{"prompt": "x", ', b"[1, 2]"):
        status, _, raw = _post(gateway, "/v1/completions", data)
        assert status == 400
        assert json.loads(raw)["error"]["type"] == "BadRequestError"


def test_overload_is_a_429_with_retry_after(mesh, model_id):
    # Its only decode worker holds 4 blocks of KV: the long prompt never fits.
    body = {"model": model_id, "prompt": travel_diary(), "max_tokens": 4}
    status, headers, raw = _post(mesh.overloaded, "/v1/completions", json.dumps(body).encode())
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert json.loads(raw)["error"]["code"] == 429


def test_no_serving_worker_is_a_503(mesh, model_id):
    orphan = mesh.orphan
    client = openai.OpenAI(base_url=f"http://{orphan.http_address}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4)
    assert refused.value.status_code == 503
    with urllib.request.urlopen(f"http://{mesh.gateway.http_address}/health", timeout=30) as healthy:
        assert healthy.status == 200
    with pytest.raises(urllib.error.HTTPError) as unhealthy:
        urllib.request.urlopen(f"http://{orphan.http_address}/health", timeout=30)
    assert unhealthy.value.code == 503


def test_metrics_are_prometheus_text(gateway):
    with urllib.request.urlopen(f"http://{gateway.http_address}/metrics", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/plain")
        assert "# TYPE " in response.read().decode()


def _decode_load(worker: WorkerProcess) -> common_pb2.LoadReport:
    with grpc.insecure_channel(str(worker.address), options=channel_options()) as channel:
        return decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=30)


def _wait_idle(worker: WorkerProcess) -> None:
    """Until nothing runs, waits or is reserved on the worker, and no request holds a KV block."""
    deadline = time.monotonic() + DEADLINE_S
    while (load := _decode_load(worker)).running_requests + load.waiting_requests + load.reserved_requests \
            + load.used_kv_blocks:
        assert time.monotonic() < deadline, load
        time.sleep(0.2)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_its_request(mesh, model_id, stream):
    _wait_idle(mesh.decode)
    host, port = str(mesh.gateway.http_address).rsplit(":", 1)
    # Thousands of tokens (minutes here): the worker is idle within the deadline only if it was cancelled.
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + DEADLINE_S
    while not _decode_load(mesh.decode).running_requests:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    if stream:
        assert connection.getresponse().readline().startswith(b"data: ")
    connection.close()
    _wait_idle(mesh.decode)


def _sse_events(gateway: WorkerProcess, path: str, body: dict) -> list[dict]:
    status, _, raw = _post(gateway, path, json.dumps({**body, "stream": True}).encode())
    assert status == 200
    blocks = [block.removeprefix("data: ") for block in raw.decode().split("\n\n") if block]
    assert blocks[-1] == "[DONE]"
    return [json.loads(block) for block in blocks[:-1]]


def _ws_connect(gateway: WorkerProcess, path: str) -> websocket.WebSocket:
    return websocket.create_connection(f"ws://{gateway.http_address}{path}/ws", timeout=TIMEOUT_S)


def _ws_until_closed(connection: websocket.WebSocket) -> tuple[list[dict], int]:
    """The server's messages until it closes the connection, and its close code."""
    messages = []
    while True:
        opcode, data = connection.recv_data()
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            connection.close()
            return messages, struct.unpack("!H", data[:2])[0]
        messages.append(json.loads(data))


def _without_ids(events: list[dict]) -> list[dict]:
    # Each reply has its own id and creation time; the rest must match event for event.
    return [{name: value for name, value in event.items() if name not in ("id", "created")} for event in events]


@pytest.mark.parametrize("path, request_fields", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": CHAT}),
], ids=["completions", "chat"])
def test_websocket_streams_the_sse_events_then_usage_and_done(gateway, model_id, path, request_fields):
    body = {"model": model_id, **request_fields, "max_tokens": 8, "temperature": 0.0}
    expected = _sse_events(gateway, path, {**body, "stream_options": {"include_usage": True}})
    connection = _ws_connect(gateway, path)
    connection.send(json.dumps(body))
    messages, code = _ws_until_closed(connection)
    *events, done = messages
    assert _without_ids(events) == _without_ids(expected)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert (done, code) == ({"type": "done"}, 1000)


def test_websocket_cancel_ends_the_request_on_the_workers(mesh, model_id):
    _wait_idle(mesh.decode)
    connection = _ws_connect(mesh.gateway, "/v1/completions")
    # Thousands of tokens (minutes here): the worker is idle within the deadline only if it was cancelled.
    connection.send(json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}))
    assert json.loads(connection.recv())["choices"][0]["text"]  # streaming: running on the decode worker
    assert _decode_load(mesh.decode).running_requests == 1
    connection.send(json.dumps({"type": "cancel"}))
    messages, code = _ws_until_closed(connection)
    assert (messages[-1], code) == ({"type": "cancelled"}, 1000)
    _wait_idle(mesh.decode)


@pytest.mark.parametrize("message, param", [
    ('{"prompt": "Hi", "temperature": 500}', "temperature"),
    ("not json", None),
], ids=["bad-value", "not-json"])
def test_websocket_bad_body_is_an_error_message_and_close_1008(gateway, message, param):
    connection = _ws_connect(gateway, "/v1/completions")
    connection.send(message)
    [error], code = _ws_until_closed(connection)
    assert code == 1008
    assert (error["error"]["code"], error["error"]["type"], error["error"]["param"]) == (400, "BadRequestError", param)
