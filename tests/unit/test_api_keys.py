"""API keys at the gateway: parsing, the constant-time check, the gRPC interceptor on a real
grpc.aio server on loopback (health exempt, everything else UNAUTHENTICATED without a key), and the
HTTP middleware (health exempt, /metrics as configured)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from services.gateway.api_keys import ApiKeyInterceptor, ApiKeyMiddleware, ApiKeys, load_api_keys


def test_keys_come_from_the_file_and_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team A\nalpha-key\n\n  beta-key  \n")
    keys = load_api_keys(key_file, {"TANDEM_API_KEYS": "gamma-key, alpha-key,"})
    assert keys == ApiKeys((b"alpha-key", b"beta-key", b"gamma-key"))
    assert load_api_keys(None, {}) is None
    assert load_api_keys(None, {"TANDEM_API_KEYS": "solo"}) == ApiKeys((b"solo",))


def test_a_bad_key_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--api-key-file"):
        load_api_keys(tmp_path / "missing", {})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(empty, {})
    with pytest.raises(ValueError, match="whitespace"):
        ApiKeys((b"two words",))


def test_only_a_bearer_of_a_known_key_is_accepted() -> None:
    keys = ApiKeys((b"alpha-key", b"beta-key"))
    assert keys.accepts("Bearer beta-key")
    assert keys.accepts("bearer alpha-key")
    assert not keys.accepts("Bearer alpha")
    assert not keys.accepts("Bearer alpha-key-and-more")
    assert not keys.accepts("Basic alpha-key")
    assert not keys.accepts("alpha-key")
    assert not keys.accepts(None)
    assert "alpha" not in repr(keys)


async def _calls(metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    """(health Check, reflection's streaming ListServices) codes on a server behind the interceptor."""
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys((b"alpha-key",)))])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    reflection.enable_server_reflection([reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                                metadata=metadata)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10, metadata=metadata)
            try:
                async for _ in call:
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
    finally:
        await server.stop(None)
    return codes[0], codes[1]


def test_the_interceptor_refuses_calls_without_a_key_but_not_health() -> None:
    assert asyncio.run(_calls(())) == (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED)
    wrong = (("authorization", "Bearer beta-key"),)
    assert asyncio.run(_calls(wrong)) == (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED)
    right = (("authorization", "Bearer alpha-key"),)
    assert asyncio.run(_calls(right)) == (grpc.StatusCode.OK, grpc.StatusCode.OK)


def _http_statuses(metrics_auth: bool, headers: dict[str, str]) -> dict[str, int]:
    """Status per path of a Starlette app behind the middleware (served in-process by TestClient)."""
    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(path, ok) for path in ("/health", "/metrics", "/v1/models")])
    guarded = ApiKeyMiddleware(app, ApiKeys((b"alpha-key",)), metrics_auth=metrics_auth)
    with TestClient(guarded) as client:
        return {path: client.get(path, headers=headers).status_code for path in ("/health", "/metrics", "/v1/models")}


def test_the_middleware_exempts_health_and_metrics_as_configured() -> None:
    assert _http_statuses(False, {}) == {"/health": 200, "/metrics": 200, "/v1/models": 401}
    assert _http_statuses(True, {}) == {"/health": 200, "/metrics": 401, "/v1/models": 401}
    assert _http_statuses(True, {"Authorization": "Bearer alpha-key"}) == {"/health": 200, "/metrics": 200,
                                                                          "/v1/models": 200}
