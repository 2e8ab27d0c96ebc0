"""Security end to end with real processes: a prefill and a decode worker (gRPC KV backend) and a
gateway, every internal link mutual TLS with certificates from a test CA, the client API over TLS
and behind API keys. Workers refuse peers without a certificate from the CA; the gateway refuses
calls without a key (UNAUTHENTICATED / 401) and serves those with one; health needs no key. Keys
come from TANDEM_API_KEYS and a TOML key file whose keys have rate limits (OpenAI's x-ratelimit-*
headers, 429 / RESOURCE_EXHAUSTED once spent) and their usage on /metrics."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import websocket
from certs import TestCa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.mesh import running
from harness.paths import REPO
from harness.ports import free_port
from harness.worker import WorkerProcess
from services.client import TandemClient
from services.common.channels import Channels
from services.common.tls import TlsConfig

Mesh = dict[str, WorkerProcess]
Pki = dict[str, Path]

API_KEY = "test-key-7f3a"
# Each key serves one test. A key of 1 token a minute is in debt for minutes after one request
# (charged 1 token at admission, settled with its prompt and output), so its next one is refused
# however slowly the machine runs.
KEY_FILE = """
[[key]]
name = "metered"
secret = "sk-metered"
requests_per_minute = 1000
tokens_per_minute = 100000

[[key]]
name = "tight-http"
secret = "sk-tight-http"
tokens_per_minute = 1

[[key]]
name = "tight-grpc"
secret = "sk-tight-grpc"
tokens_per_minute = 1
"""
TIMEOUT_S = 300.0
WORKER_FLAGS = ["--threads", "1", "--kv-cache-mib", "64"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = TestCa(folder / "ca", "Tandem test CA"), TestCa(folder / "other", "Another CA")
    paths = {"ca": ca.cert_file}
    for name, authority in (("prefill", ca), ("decode", ca), ("gateway", ca), ("stranger", other)):
        issued = authority.issue(name)
        paths[f"{name}_cert"], paths[f"{name}_key"] = issued.cert_file, issued.key_file
    return paths


def _tls_flags(pki: dict[str, Path], name: str) -> list[str]:
    return ["--tls-cert", str(pki[f"{name}_cert"]), "--tls-key", str(pki[f"{name}_key"]), "--tls-ca", str(pki["ca"])]


@pytest.fixture(scope="module")
def mesh(pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.toml"
    key_file.write_text(KEY_FILE)
    prefill_port, decode_port = free_port(), free_port()
    arg_lists = [
        ["prefill", "--port", str(prefill_port), *WORKER_FLAGS, *_tls_flags(pki, "prefill")],
        ["decode", "--port", str(decode_port), "--kv-backend", "grpc", *WORKER_FLAGS, *_tls_flags(pki, "decode")],
        ["gateway", "--port", "0", "--http-port", "0", "--prefill", f"127.0.0.1:{prefill_port}",
         "--decode", f"127.0.0.1:{decode_port}", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000",
         "--metrics-auth", "on", "--api-key-file", str(key_file), *_tls_flags(pki, "gateway")],
    ]
    with running(arg_lists, env={"TANDEM_API_KEYS": f"other-key,{API_KEY}"}) as processes:
        yield {"prefill": processes[0], "decode": processes[1], "gateway": processes[2]}


def _health(address: str, tls: TlsConfig | None) -> grpc.StatusCode:
    async def check() -> grpc.StatusCode:
        async with Channels(tls).open(address) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            except grpc.aio.AioRpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    return asyncio.run(check())


def test_a_request_crosses_the_mtls_mesh_with_a_key(mesh: Mesh, pki: Pki) -> None:
    with TandemClient(str(mesh["gateway"].address), api_key=API_KEY, ca_file=pki["ca"]) as client:
        chunks = list(client.generate("The capital of France is", max_tokens=8, temperature=0.0, timeout=TIMEOUT_S))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert "".join(chunk.text for chunk in chunks).strip()


def test_the_gateway_refuses_grpc_calls_without_a_valid_key(mesh: Mesh, pki: Pki) -> None:
    for key in (None, "wrong-key"):
        with TandemClient(str(mesh["gateway"].address), api_key=key, ca_file=pki["ca"]) as client, \
                pytest.raises(grpc.RpcError) as error:
            client.list_models(timeout=TIMEOUT_S)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with TandemClient(str(mesh["gateway"].address), api_key=API_KEY, ca_file=pki["ca"]) as client:
        assert client.list_models(timeout=TIMEOUT_S)


def _http(mesh: Mesh, pki: Pki, path: str, key: str | None) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"https://{mesh['gateway'].http_address}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _complete(mesh: Mesh, pki: Pki, key: str) -> tuple[int, dict[str, str], dict]:
    """POST /v1/completions with `key`: status, headers (lower-case names) and JSON body."""
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"https://{mesh['gateway'].http_address}/v1/completions", body,
                                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def test_a_limited_key_is_told_its_limits_and_its_usage_is_counted(mesh: Mesh, pki: Pki) -> None:
    status, headers, body = _complete(mesh, pki, "sk-metered")
    assert status == 200, body
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-limit-tokens"]) == ("1000", "100000")
    assert 0 < int(headers["x-ratelimit-remaining-requests"]) <= 1000
    assert 0 < int(headers["x-ratelimit-remaining-tokens"]) <= 100000
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    metrics = _http(mesh, pki, "/metrics", API_KEY)[1].decode()

    def sample(family: str) -> float:
        (line,) = [line for line in metrics.splitlines() if line.startswith(f'{family}{{key="metered",')]
        return float(line.rsplit(" ", 1)[1])

    assert sample("tandem:key_requests_total") == 1
    assert sample("tandem:key_prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert sample("tandem:key_generation_tokens_total") == body["usage"]["completion_tokens"] == 4
    assert "sk-metered" not in metrics


def test_an_http_caller_over_its_tokens_a_minute_gets_429(mesh: Mesh, pki: Pki) -> None:
    assert _complete(mesh, pki, "sk-tight-http")[0] == 200  # a full bucket lets one request in
    status, headers, body = _complete(mesh, pki, "sk-tight-http")
    assert status == 429 and body["error"]["type"] == "RateLimitError", body
    assert "'tight-http'" in body["error"]["message"]
    # In debt by its prompt and output: minutes to wait, not seconds.
    assert int(headers["retry-after"]) > 60
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("1", "0")
    assert "x-ratelimit-limit-requests" not in headers


def test_a_grpc_caller_over_its_limit_gets_resource_exhausted(mesh: Mesh, pki: Pki) -> None:
    with TandemClient(str(mesh["gateway"].address), api_key="sk-tight-grpc", ca_file=pki["ca"]) as client:
        stream = client.generate("The capital of France is", max_tokens=4, timeout=TIMEOUT_S)
        assert list(stream)[-1].usage
        # Its limits come back as trailers, as the HTTP API sends them as headers.
        trailers = stream.trailers()
        assert (trailers["x-ratelimit-limit-tokens"], trailers["x-ratelimit-remaining-tokens"]) == ("1", "0")
        assert "x-ratelimit-limit-requests" not in trailers
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate("The capital of France is", max_tokens=4, timeout=TIMEOUT_S))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'tight-grpc'" in refused.value.details()
    refusal_trailers = dict(refused.value.trailing_metadata())
    assert int(refusal_trailers["retry-after"]) > 60 and refusal_trailers["x-ratelimit-remaining-tokens"] == "0"


def test_the_http_api_asks_for_a_key_but_not_for_health(mesh: Mesh, pki: Pki) -> None:
    status, body = _http(mesh, pki, "/v1/models", None)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "AuthenticationError"
    assert _http(mesh, pki, "/v1/models", "wrong-key")[0] == 401
    status, body = _http(mesh, pki, "/v1/models", API_KEY)
    assert status == 200 and json.loads(body)["data"]
    assert _http(mesh, pki, "/health", None)[0] == 200
    # --metrics-auth on: the metrics need a key too.
    assert _http(mesh, pki, "/metrics", None)[0] == 401
    assert _http(mesh, pki, "/metrics", API_KEY)[0] == 200


def test_the_websocket_handshake_asks_for_a_key(mesh: Mesh, pki: Pki) -> None:
    url = f"wss://{mesh['gateway'].http_address}/v1/completions/ws"
    tls = {"ca_certs": str(pki["ca"])}
    for key in (None, "wrong-key"):
        header = [f"Authorization: Bearer {key}"] if key else []
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            websocket.create_connection(url, timeout=TIMEOUT_S, sslopt=tls, header=header)
        assert refused.value.status_code == 401
        assert json.loads(refused.value.resp_body)["error"]["type"] == "AuthenticationError"
    connection = websocket.create_connection(url, timeout=TIMEOUT_S, sslopt=tls,
                                             header=[f"Authorization: Bearer {API_KEY}"])
    connection.send(json.dumps({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0.0}))
    messages = [json.loads(message) for message in iter(connection.recv, "")]
    connection.close()
    assert messages[-1] == {"type": "done"} and messages[-2]["usage"]["completion_tokens"] == 2


def test_grpc_health_needs_no_key(mesh: Mesh, pki: Pki) -> None:
    gateway = str(mesh["gateway"].address)
    async def check() -> int:
        credentials = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        async with grpc.aio.secure_channel(gateway, credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        return reply.status

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


def test_workers_refuse_peers_without_a_certificate_from_the_ca(mesh: Mesh, pki: Pki) -> None:
    member = TlsConfig(pki["gateway_cert"], pki["gateway_key"], pki["ca"])
    stranger = TlsConfig(pki["stranger_cert"], pki["stranger_key"], pki["ca"])
    for role in ("prefill", "decode"):
        address = str(mesh[role].address)
        assert _health(address, member) == grpc.StatusCode.OK
        assert _health(address, None) == grpc.StatusCode.UNAVAILABLE
        assert _health(address, stranger) == grpc.StatusCode.UNAVAILABLE


def test_probe_checks_a_worker_with_the_pods_certificate(mesh: Mesh, pki: Pki) -> None:
    def probe(*flags: str) -> int:
        command = [sys.executable, "-m", "services.cli", "probe", str(mesh["decode"].address), "--timeout", "30"]
        return subprocess.run([*command, *flags], cwd=REPO, capture_output=True, timeout=TIMEOUT_S).returncode

    assert probe(*_tls_flags(pki, "decode")) == 0
    assert probe() == 1
