"""The HTTP API's limits on a real uvicorn server on loopback: body size (413), content type (400)
and requests in flight (429), each answered with an OpenAI-style error body naming the limit."""

from __future__ import annotations

import asyncio
import http.client
import json

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.http_server import HttpListener
from services.gateway.openai_api.errors import ApiError
from services.gateway.openai_api.http_limits import ConcurrencyLimit, read_json_body

MAX_BODY_BYTES = 1024


def _app(entered: asyncio.Event, release: asyncio.Event, refusals: list[str]) -> Starlette:
    async def echo(request: Request) -> Response:
        try:
            body = await read_json_body(request, MAX_BODY_BYTES)
        except ApiError as error:
            return error.response()
        return JSONResponse({"bytes": len(body)})

    async def hold(request: Request) -> Response:
        entered.set()
        await release.wait()
        return JSONResponse({})

    async def health(request: Request) -> Response:
        return Response()

    return Starlette(
        routes=[Route("/v1/echo", echo, methods=["POST"]), Route("/v1/hold", hold), Route("/health", health)],
        middleware=[Middleware(ConcurrencyLimit, limit=1, on_refused=refusals.append)],
    )


def _request(address: str, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None, chunked: bool = False) -> tuple[int, dict]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        payload = iter([body]) if chunked and body is not None else body
        connection.request(method, path, payload, headers or {}, encode_chunked=chunked)
        response = connection.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else {}
    finally:
        connection.close()


def test_http_limits():
    async def run() -> None:
        entered, release, refusals = asyncio.Event(), asyncio.Event(), []
        listener = HttpListener(_app(entered, release, refusals), "127.0.0.1", 0)
        address = await listener.start()
        call = asyncio.to_thread
        try:
            json_type = {"Content-Type": "application/json"}
            status, body = await call(_request, address, "POST", "/v1/echo", b"{}", json_type)
            assert (status, body) == (200, {"bytes": 2})
            # Over the limit, announced (Content-Length) or not (chunked): 413 naming the limit.
            for chunked in (False, True):
                status, body = await call(_request, address, "POST", "/v1/echo", b" " * (MAX_BODY_BYTES + 1),
                                          chunked=chunked)
                assert status == 413 and "max_body_bytes" in body["error"]["message"], body
            status, body = await call(_request, address, "POST", "/v1/echo", b"{}", {"Content-Type": "text/plain"})
            assert status == 400 and body["error"]["param"] == "Content-Type", body
            # One request in flight is the limit: a second one is refused at once, health is not limited.
            holding = asyncio.ensure_future(call(_request, address, "GET", "/v1/hold"))
            await entered.wait()
            status, body = await call(_request, address, "GET", "/v1/hold")
            assert status == 429 and "max_concurrent_requests: 1" in body["error"]["message"], body
            assert len(refusals) == 1
            assert (await call(_request, address, "GET", "/health"))[0] == 200
            release.set()
            assert (await holding)[0] == 200
        finally:
            await listener.stop(1.0)

    asyncio.run(run())

