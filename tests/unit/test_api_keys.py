"""API keys at the gateway: the constant-time check naming the key, the gRPC interceptor on a real
grpc.aio server on loopback (health exempt, everything else UNAUTHENTICATED without a key), and the
HTTP middleware (health exempt, /metrics as configured; the caller handed to the app, and the
x-ratelimit-* headers of a limited one). Reading key files: test_key_file.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from services.gateway.api_keys import ApiKey, ApiKeyInterceptor, ApiKeyMiddleware, ApiKeys, current_caller
from services.gateway.caller import Caller, KeyLimits
from services.gateway.rate_limits import RateLimiter


def _keys(*secrets: str) -> ApiKeys:
    return ApiKeys(tuple(ApiKey(Caller(f"key-{number}"), secret.encode()) for number, secret in
                         enumerate(secrets, 1)))


def test_only_a_bearer_of_a_known_key_is_identified_and_as_which() -> None:
    keys = _keys("alpha-key", "beta-key")
    assert keys.identify("Bearer beta-key") == Caller("key-2")
    assert keys.identify("bearer alpha-key") == Caller("key-1")
    for refused in ("Bearer alpha", "Bearer alpha-key-and-more", "Basic alpha-key", "alpha-key", None):
        assert keys.identify(refused) is None
    assert "alpha" not in repr(keys)
    with pytest.raises(ValueError, match="whitespace"):
        _keys("two words")
    with pytest.raises(ValueError, match="no key given"):
        ApiKeys(())


async def _calls(metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    """(health Check, reflection's streaming ListServices) codes on a server behind the interceptor."""
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(_keys("alpha-key"))])
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
    guarded = ApiKeyMiddleware(app, _keys("alpha-key"), metrics_auth=metrics_auth)
    with TestClient(guarded) as client:
        return {path: client.get(path, headers=headers).status_code for path in ("/health", "/metrics", "/v1/models")}


def test_the_middleware_exempts_health_and_metrics_as_configured() -> None:
    assert _http_statuses(False, {}) == {"/health": 200, "/metrics": 200, "/v1/models": 401}
    assert _http_statuses(True, {}) == {"/health": 200, "/metrics": 401, "/v1/models": 401}
    assert _http_statuses(True, {"Authorization": "Bearer alpha-key"}) == {"/health": 200, "/metrics": 200,
                                                                          "/v1/models": 200}


def test_the_middleware_hands_the_app_its_caller_and_tells_a_limited_one_its_limits() -> None:
    limiter = RateLimiter(lambda: 0.0)  # time stands still: only the app's own charge shows

    async def whoami(request: Request) -> PlainTextResponse:
        caller = current_caller()
        assert caller is not None
        limiter.admit(caller, 10)
        return PlainTextResponse(caller.name)

    keys = ApiKeys((ApiKey(Caller("team-a", KeyLimits(requests_per_minute=5)), b"alpha-key"),
                    ApiKey(Caller("team-b"), b"beta-key")))
    app = ApiKeyMiddleware(Starlette(routes=[Route("/v1/whoami", whoami)]), keys, metrics_auth=False,
                           rate_limits=limiter)
    with TestClient(app) as client:
        limited = client.get("/v1/whoami", headers={"Authorization": "Bearer alpha-key"})
        unlimited = client.get("/v1/whoami", headers={"Authorization": "Bearer beta-key"})
    assert limited.text == "team-a"
    assert (limited.headers["x-ratelimit-limit-requests"], limited.headers["x-ratelimit-remaining-requests"],
            limited.headers["x-ratelimit-reset-requests"]) == ("5", "4", "12s")
    assert "x-ratelimit-limit-tokens" not in limited.headers
    assert unlimited.text == "team-b"
    assert not [name for name in unlimited.headers if name.startswith("x-ratelimit-")]
    assert current_caller() is None  # nothing leaks out of a request
