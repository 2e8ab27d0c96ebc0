"""Bad input, fuzzed, against a real mesh (gateway, prefill and decode processes on loopback): every
public field of the gRPC API (tandem.v1.GenerateRequest), the OpenAI API's bodies (from their pydantic
JSON schema) over HTTP and over the WebSocket, and the workers' internal RPCs (Abort, WatchLoad too)
get values valid and not. Every answer is a success or a refusal that names the field
(INVALID_ARGUMENT / 400; NOT_FOUND / 404 for another model; 413 for a body over the limit), never
INTERNAL or 500; afterwards every process still serves and holds nothing. KVTransfer.Push is fuzzed
in test_kvtransfer_fuzz.py.

Hypothesis runs derandomized with a bounded number of examples (tests/fuzzing.py: `make fuzz` runs
the same properties with fresh seeds and more examples). Each bug the fuzzing found stays as an @example.
"""

from __future__ import annotations

import http.client
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import websocket
from bad_input_strategies import (
    decode_requests,
    generate_requests,
    malformed_json,
    openai_bodies,
    prefill_requests,
    with_invalid_utf8,
)
from fuzzing import examples
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tandem.v1 import (
    common_pb2,
    decode_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
)

from harness.leak_check import assert_no_leaks
from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker
from kvtransfer.descriptor import TransferTarget, split_address
from services.common.server import channel_options
from services.gateway.openai_api.schema import ChatBody, CompletionBody

# Small limits, so that oversized prompts are cheap to refuse and valid requests cheap to serve.
MAX_PROMPT_TOKENS = 48
MAX_TOTAL_TOKENS = 64
MAX_BODY_BYTES = 64 * 1024
TIMEOUT_S = 120.0
FUZZ = settings(max_examples=examples(60))  # the rest from the profile (tests/fuzzing.py)
# "field: what is wrong" is how every refusal names its field (see services/common/errors.py).
NAMES_A_FIELD = re.compile(r"^[A-Za-z_][\w.\-]*: ")


@dataclass
class Mesh:
    gateway: WorkerProcess
    prefill: WorkerProcess
    decode: WorkerProcess
    model_id: str

    @property
    def processes(self) -> list[WorkerProcess]:
        return [self.gateway, self.prefill, self.decode]


@pytest.fixture(scope="module")
def mesh():
    # A short KV timeout: a well-formed target where no receiver waits fails within it.
    prefill = ["prefill", "--port", str(free_port()), "--threads", "1", "--kv-cache-mib", "128", "--kv-timeout", "5"]
    decode = ["decode", "--port", str(free_port()), "--threads", "1", "--kv-cache-mib", "128", "--kv-timeout", "5"]
    gateway = ["gateway", "--port", "0", "--http-port", "0", "--prefill", f"127.0.0.1:{prefill[2]}",
               "--decode", f"127.0.0.1:{decode[2]}", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000",
               "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--max-total-tokens", str(MAX_TOTAL_TOKENS),
               "--max-body-bytes", str(MAX_BODY_BYTES)]
    processes = [start_worker(args, wait=False) for args in (prefill, decode, gateway)]
    try:
        for process in processes:
            process.wait_ready()
        with grpc.insecure_channel(str(processes[2].address), options=channel_options()) as channel:
            models = gateway_pb2_grpc.GatewayStub(channel).ListModels(gateway_pb2.ListModelsRequest(), timeout=30)
        yield Mesh(processes[2], processes[0], processes[1], models.models[0].id)
    finally:
        codes = [process.stop() for process in reversed(processes)]
        assert codes == [0] * len(processes)


@pytest.fixture(scope="module")
def gateway_channel(mesh):
    with grpc.insecure_channel(str(mesh.gateway.address), options=channel_options()) as channel:
        yield channel


def _assert_refusal_names_a_field(error: grpc.RpcError, request: Any) -> None:
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        assert "model" in details, details
        return
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}\n{request}"
    assert NAMES_A_FIELD.match(details), details


def _generate(channel: grpc.Channel, request: bytes | Any, method: str = "/tandem.v1.Gateway/Generate",
              response_type: Any = gateway_pb2.GenerateResponse) -> list[Any]:
    """The responses of one server-streaming call; `request` may be raw bytes (sent as they are)."""
    serialize = (lambda raw: raw) if isinstance(request, bytes) else type(request).SerializeToString
    call = channel.unary_stream(method, request_serializer=serialize, response_deserializer=response_type.FromString)
    return list(call(request, timeout=TIMEOUT_S))


def _fuzz_grpc(channel: grpc.Channel, request: gateway_pb2.GenerateRequest) -> None:
    try:
        responses = _generate(channel, request)
    except grpc.RpcError as error:
        # A valid request whose objectives the workers cannot meet now is refused as overload, not as
        # bad input: a TTFT of 100 ms arriving while the previous request still runs, say.
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and request.HasField("slo") \
                and (error.details() or "").startswith("no worker can meet"):
            return
        _assert_refusal_names_a_field(error, request)
        return
    assert responses[-1].chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def test_generate_requests_fuzzed(mesh, gateway_channel):
    @FUZZ
    @given(generate_requests(mesh.model_id))
    def fuzz(request: gateway_pb2.GenerateRequest) -> None:
        _fuzz_grpc(gateway_channel, request)

    fuzz()
    _assert_alive_and_idle(mesh)


@pytest.mark.parametrize(("field", "mutate"), [
    ("request_id", lambda r: setattr(r, "request_id", "MARKER")),
    ("model", lambda r: setattr(r, "model", "MARKER")),
    ("text", lambda r: setattr(r, "text", "MARKER")),
    ("chat.messages.0.content", lambda r: r.chat.messages.add(role="user", content="MARKER")),
    ("sampling.stop.0", lambda r: r.sampling.stop.append("MARKER")),
])
def test_invalid_utf8_in_a_string_field_is_invalid_argument(mesh, gateway_channel, field, mutate):
    request = gateway_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingParams(max_tokens=1))
    mutate(request)
    with pytest.raises(grpc.RpcError) as refused:
        _generate(gateway_channel, with_invalid_utf8(request, "MARKER"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert refused.value.details() == f"{field}: is not valid UTF-8", refused.value.details()
    _assert_alive_and_idle(mesh)


@pytest.mark.parametrize(("request_fields", "field", "words"), [
    ({"text": "word " * 60}, "prompt", "max_prompt_tokens"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[1] * 40), "sampling": common_pb2.SamplingParams(max_tokens=30)},
     "max_tokens", "max_total_tokens"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[10**6])}, "token_ids", "vocabulary"),
    ({"text": "Hi", "sampling": common_pb2.SamplingParams(temperature=float("nan"))}, "sampling.temperature", "nan"),
])
def test_limits_and_bad_values_are_named(gateway_channel, request_fields, field, words):
    with pytest.raises(grpc.RpcError) as refused:
        _generate(gateway_channel, gateway_pb2.GenerateRequest(**request_fields))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field}: ") and words in refused.value.details()


def _well_formed(parse: Callable[[], Any]) -> bool:
    try:
        parse()
    except ValueError:
        return False
    return True


def test_decode_generate_fuzzed(mesh):
    with grpc.insecure_channel(str(mesh.decode.address), options=channel_options()) as channel:
        @settings(max_examples=examples(40))
        @given(decode_requests(str(mesh.prefill.address)))
        # Found by this test: a malformed prefill address was UNAVAILABLE after a failed name lookup.
        @example(decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2], prefill_address="<|im_start|>"))
        def fuzz(request: decode_pb2.DecodeRequest) -> None:
            try:
                chunks = _generate(channel, request, "/tandem.v1.Decode/Generate", common_pb2.TokenChunk)
            except grpc.RpcError as error:
                # A well-formed address where no prefill worker listens is not bad input.
                if error.code() == grpc.StatusCode.UNAVAILABLE and request.prefill_address != mesh.prefill.address \
                        and _well_formed(lambda: split_address(request.prefill_address)):
                    return
                _assert_refusal_names_a_field(error, request)
                return
            assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

        fuzz()
    _assert_alive_and_idle(mesh)


def test_prefill_fuzzed(mesh):
    with grpc.insecure_channel(str(mesh.decode.address), options=channel_options()) as channel:
        handshake = kvtransfer_pb2_grpc.KVTransferStub(channel).Handshake(kvtransfer_pb2.HandshakeRequest(), timeout=30)
    with grpc.insecure_channel(str(mesh.prefill.address), options=channel_options()) as channel:
        prefill = channel.unary_unary("/tandem.v1.Prefill/Prefill",
                                      request_serializer=prefill_pb2.PrefillRequest.SerializeToString,
                                      response_deserializer=prefill_pb2.PrefillResponse.FromString)

        @settings(max_examples=examples(40))
        @given(prefill_requests(handshake.layout))
        # Found by this test: a malformed rendezvous was dialled, and UNAVAILABLE after the KV timeout.
        @example(prefill_pb2.PrefillRequest(
            request_id="r", prompt_token_ids=[1, 2],
            kv_target=kvtransfer_pb2.KVTarget(layout=handshake.layout, torch_dist=kvtransfer_pb2.TorchDistTarget(
                host="", port=31288, namespace="n"))))
        def fuzz(request: prefill_pb2.PrefillRequest) -> None:
            try:
                prefill(request, timeout=TIMEOUT_S)
            except grpc.RpcError as error:
                # Another layout, or a well-formed target where no receiver waits, is not bad input.
                well_formed = _well_formed(lambda: TransferTarget.from_proto(request.kv_target))
                if not (well_formed and error.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                                         grpc.StatusCode.UNAVAILABLE)):
                    _assert_refusal_names_a_field(error, request)

        fuzz()
    _assert_alive_and_idle(mesh)


def _post(mesh: Mesh, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, bytes]:
    host, port = str(mesh.gateway.http_address).rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        connection.request("POST", path, body, {"Content-Type": content_type} if content_type else {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _assert_http_answer(status: int, raw: bytes, body: Any, model_id: str) -> None:
    """A body of the API's (under the size limit) is answered 200 or refused 400, or 404 when it names
    a model this gateway does not serve."""
    other_model = isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] != model_id
    assert status in ((200, 400, 404) if other_model else (200, 400)), (status, raw[:500], body)
    if status == 200:
        if raw.startswith(b"data: "):
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            assert not any(b'"error"' in event for event in events[:-1]), raw[:500]
        return
    error = json.loads(raw)["error"]
    assert error["code"] == status, error
    if status == 400:
        assert error["param"] or error["message"].startswith("the body"), error
        assert error["param"] is None or error["message"].startswith(error["param"]) or \
            error["param"] in ("prompt", "messages", "model"), error


@pytest.mark.parametrize(("path", "schema", "prompt"), [
    ("/v1/completions", CompletionBody.model_json_schema(), {"prompt": "0"}),
    ("/v1/chat/completions", ChatBody.model_json_schema(), {"messages": [{"role": "user", "content": "0"}]}),
], ids=["completions", "chat"])
def test_openai_bodies_fuzzed(mesh, path, schema, prompt):
    @FUZZ
    @given(openai_bodies(schema, mesh.model_id))
    # Found by this test: values beyond what the workers' protobuf fields carry were a 400 naming no field.
    @example({**prompt, "max_tokens": 1, "top_k": 2**31})
    @example({**prompt, "max_tokens": 1, "stop_token_ids": [2**32]})
    def fuzz(body: dict[str, Any]) -> None:
        status, raw = _post(mesh, path, json.dumps(body).encode())
        _assert_http_answer(status, raw, body, mesh.model_id)

    fuzz()
    _assert_alive_and_idle(mesh)


@FUZZ
@given(raw=malformed_json, content_type=st.sampled_from([
    "application/json", None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1",
]))
def test_malformed_json_and_wrong_content_types_are_400(mesh, raw, content_type):
    status, answer = _post(mesh, "/v1/completions", raw, content_type)
    assert status == 400, (status, answer[:500], raw)
    _assert_http_answer(status, answer, raw, mesh.model_id)


def test_a_body_over_the_limit_is_413(mesh):
    body = json.dumps({"model": mesh.model_id, "prompt": "x" * (MAX_BODY_BYTES + 1), "max_tokens": 1}).encode()
    status, raw = _post(mesh, "/v1/completions", body)
    assert status == 413 and "max_body_bytes" in json.loads(raw)["error"]["message"]


def _ws_answer(mesh: Mesh, path: str, message: bytes, binary: bool) -> tuple[list[dict], int]:
    """Send one message on a new WebSocket at `path`; the server's messages until it closed, and its close code."""
    connection = websocket.create_connection(f"ws://{mesh.gateway.http_address}{path}/ws", timeout=TIMEOUT_S)
    try:
        connection.send(message, websocket.ABNF.OPCODE_BINARY if binary else websocket.ABNF.OPCODE_TEXT)
        messages = []
        while True:
            opcode, data = connection.recv_data()
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                return messages, struct.unpack("!H", data[:2])[0]
            messages.append(json.loads(data))
    finally:
        connection.close()


def _assert_ws_answer(messages: list[dict], code: int, body: Any, model_id: str) -> None:
    """A stream of events ending {"type": "done"} and close 1000, or the POST endpoint's refusal as an
    error message and close 1008 (never 1011, an internal error)."""
    if code == 1000:
        *events, done = messages
        assert done == {"type": "done"} and not any("error" in event for event in events), (messages, body)
        return
    # Refused before it started: the error alone; failed once streaming (a prompt over the limit is
    # found when the workers take it): the events so far, then the error (websocket.py's protocol).
    assert code == 1008, (code, messages, body)
    *events, answer = messages
    assert not any("error" in event for event in events), (messages, body)
    error = answer["error"]
    assert error["code"] in (400, 404), (error, body)
    _assert_http_answer(error["code"], json.dumps(answer).encode(), body, model_id)


@pytest.mark.parametrize(("path", "schema", "prompt"), [
    ("/v1/completions", CompletionBody.model_json_schema(), {"prompt": "0"}),
    ("/v1/chat/completions", ChatBody.model_json_schema(), {"messages": [{"role": "user", "content": "0"}]}),
], ids=["completions", "chat"])
def test_websocket_bodies_fuzzed(mesh, path, schema, prompt):
    @settings(max_examples=examples(30))
    @given(openai_bodies(schema, mesh.model_id), st.booleans())
    # Found by this test: a chat prompt over max_prompt_tokens is refused after the first event.
    @example({"messages": [{"role": "000000000\x80\u00c4\u0d40\U000c0000"}]}, False)
    def fuzz(body: dict[str, Any], binary: bool) -> None:
        messages, code = _ws_answer(mesh, path, json.dumps(body).encode(), binary)
        _assert_ws_answer(messages, code, body, mesh.model_id)

    fuzz()
    _assert_alive_and_idle(mesh)


@settings(max_examples=examples(30))
@given(raw=malformed_json)
def test_malformed_json_on_the_websocket_is_400_and_close_1008(mesh, raw):
    messages, code = _ws_answer(mesh, "/v1/completions", raw, binary=True)
    assert code == 1008, (code, messages, raw)
    [answer] = messages
    assert answer["error"]["code"] == 400, (answer, raw)


def _worker_rpc(process: WorkerProcess, service: str, method: str, request: bytes | Any, response_type: Any,
                stream: bool = False) -> Any:
    """The answer of a unary RPC, or the first of a streaming one; `request` may be raw bytes."""
    serialize = (lambda raw: raw) if isinstance(request, bytes) else type(request).SerializeToString
    with grpc.insecure_channel(str(process.address), options=channel_options()) as channel:
        call = (channel.unary_stream if stream else channel.unary_unary)(
            f"/tandem.v1.{service}/{method}", request_serializer=serialize,
            response_deserializer=response_type.FromString)
        if not stream:
            return call(request, timeout=30)
        responses = call(request, timeout=30)
        try:
            return next(responses)
        finally:
            responses.cancel()


_WORKERS = [("prefill", "Prefill"), ("decode", "Decode")]


@pytest.mark.parametrize(("role", "service"), _WORKERS, ids=[role for role, _ in _WORKERS])
def test_abort_fuzzed(mesh, role, service):
    process = getattr(mesh, role)

    @settings(max_examples=examples(30))
    @given(st.text(max_size=300))
    def fuzz(request_id: str) -> None:
        # Nothing runs: an Abort of any id finds nothing, and ends nothing.
        answer = _worker_rpc(process, service, "Abort", common_pb2.AbortRequest(request_id=request_id),
                             common_pb2.AbortResponse)
        assert not answer.found

    fuzz()
    with pytest.raises(grpc.RpcError) as refused:
        raw = with_invalid_utf8(common_pb2.AbortRequest(request_id="MARKER"), "MARKER")
        _worker_rpc(process, service, "Abort", raw, common_pb2.AbortResponse)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    _assert_alive_and_idle(mesh)


@pytest.mark.parametrize(("role", "service"), _WORKERS, ids=[role for role, _ in _WORKERS])
def test_watch_load_fuzzed(mesh, role, service):
    process = getattr(mesh, role)

    @settings(max_examples=examples(20))
    @given(st.one_of(st.just(0), st.just(2**32 - 1), st.integers(0, 2**32 - 1)))
    @example(0)  # the default interval
    @example(2**32 - 1)  # weeks: the first report still comes at once
    def fuzz(interval_ms: int) -> None:
        report = _worker_rpc(process, service, "WatchLoad", common_pb2.WatchLoadRequest(interval_ms=interval_ms),
                             common_pb2.LoadReport, stream=True)
        assert report.total_kv_blocks > 0

    fuzz()
    _assert_alive_and_idle(mesh)


def _assert_alive_and_idle(mesh: Mesh) -> None:
    for process in mesh.processes:
        assert process.proc.poll() is None, f"{process.args[0]} died:\n{process.log_tail()}"
        with grpc.insecure_channel(str(process.address), options=channel_options()) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert_no_leaks([mesh.prefill, mesh.decode])
