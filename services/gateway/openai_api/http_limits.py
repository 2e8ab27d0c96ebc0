"""The HTTP API's own limits: what a body may be, and how many requests may be in flight.

uvicorn (h11) serves one request at a time per HTTP/1.1 connection, so the HTTP counterpart of
gRPC's streams per connection is a bound on the requests the whole server has in flight: the
requests beyond it get 429 at once, before their body is read.

Per-key rate limits (services.gateway.rate_limits) are told to HTTP callers in OpenAI's
x-ratelimit-* headers (`rate_limit_headers`).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.openai_api.errors import ApiError, bad_request
from services.gateway.rate_limits import KeyStatus


async def read_json_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, read no further than `max_bytes`: 413 when it is larger, 400 when its
    Content-Type is given and is not JSON (as vLLM's FastAPI does)."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.partition(";")[0].strip().lower()
        kind, _, subtype = media_type.partition("/")
        if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
            raise bad_request(f"Content-Type: must be application/json, got {content_type[:64]!r}", "Content-Type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large(max_bytes)
    return bytes(body)


def too_large(max_bytes: int) -> ApiError:
    """The 413 of a body larger than `max_bytes`."""
    return ApiError(413, f"the body exceeds the limit of {max_bytes} bytes (max_body_bytes)", "BadRequestError")


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` requests under /v1/ in flight (a streamed reply counts until
    its last event, a WebSocket until it closes); those beyond get 429 with a Retry-After hint (a
    WebSocket's on its handshake), and `on_refused` hears of them."""

    def __init__(self, app: ASGIApp, limit: int, on_refused: Callable[[str], None] = lambda message: None) -> None:
        self.app = app
        self.limit = limit
        self.on_refused = on_refused
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            message = (f"{self.in_flight} requests are in flight, the limit of concurrent requests "
                       f"(max_concurrent_requests: {self.limit})")
            self.on_refused(message)
            await ApiError(429, message, "RateLimitError").response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def rate_limit_headers(status: KeyStatus) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers for a key's limits (services.gateway.rate_limits)."""
    return [(name.encode(), value.encode()) for name, value in status.fields()]
