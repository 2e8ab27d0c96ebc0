"""API keys at the gateway: every client route of both APIs asks for `Authorization: Bearer <key>`.

gRPC callers send it as `authorization` metadata (checked by `ApiKeyInterceptor`), HTTP callers as
a header (checked by `ApiKeyMiddleware`, which answers 401 with an OpenAI-style error body). Health
is always exempt (load balancers and probes hold no key); /metrics is exempt unless configured.
Keys come from services.gateway.key_file; no keys = no check.

Both edges tell the handlers which key a request came with through `current_caller()` (the key's
name, limits and admin mark, never its secret). grpc.aio runs a call's interceptors and its handler
in the call's own task, and an ASGI middleware awaits the app in the request's, so a context
variable reaches the handler without changing its signature. The HTTP middleware also puts the
caller's rate-limit state (services.gateway.rate_limits) on every response it answers.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.caller import Caller
from services.gateway.openai_api.errors import ApiError
from services.gateway.openai_api.http_limits import rate_limit_headers
from services.gateway.rate_limits import RateLimiter

_GRPC_EXEMPT_PREFIX = "/grpc.health.v1.Health/"
_HTTP_EXEMPT = frozenset({"/health"})
_BEARER = "bearer "
_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("tandem_caller", default=None)


def current_caller() -> Caller | None:
    """The key of the request being handled, as the interceptor or middleware identified it;
    None where the gateway asks for no key."""
    return _CALLER.get()


@dataclass(frozen=True)
class ApiKey:
    """One key: the `secret` a caller presents (never logged) and who that `caller` is."""

    caller: Caller
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not self.secret:
            raise ValueError("secret: is empty")
        if any(c in self.secret for c in b" \t\r\n,"):
            raise ValueError("secret: holds whitespace or a comma")


@dataclass(frozen=True)
class ApiKeys:
    """The keys a caller may present, with names and secrets each used once."""

    keys: tuple[ApiKey, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("--api-key-file/TANDEM_API_KEYS: no key given")
        names: dict[str, int] = {}
        secrets: dict[bytes, int] = {}
        for number, key in enumerate(self.keys, 1):
            name = key.caller.name
            if name in names:
                raise ValueError(f"key #{number} ({name}): name: already the name of key #{names[name]}")
            if key.secret in secrets:
                raise ValueError(f"key #{number} ({name}): secret: already the secret of key #{secrets[key.secret]}")
            names[name] = secrets[key.secret] = number

    def identify(self, authorization: str | None) -> Caller | None:
        """The caller whose key an `Authorization` value carries; None for none. Every key is
        compared, in constant time and as digests of equal length, so the time taken tells nothing
        about how much of a key matched or how long the keys are."""
        if authorization is None or authorization[:len(_BEARER)].lower() != _BEARER:
            return None
        given = hashlib.sha256(authorization[len(_BEARER):].strip().encode()).digest()
        matches = [hmac.compare_digest(given, hashlib.sha256(key.secret).digest()) for key in self.keys]
        return self.keys[matches.index(True)].caller if any(matches) else None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every gRPC call but health's without a valid key, with UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

        # grpc.aio takes a plain coroutine as a streaming handler too, so one refusal serves all kinds.
        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: "
                                "send metadata `authorization: Bearer <key>`")

        self._refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(refuse),
            (True, False): grpc.stream_unary_rpc_method_handler(refuse),
            (True, True): grpc.stream_stream_rpc_method_handler(refuse),
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if details.method.startswith(_GRPC_EXEMPT_PREFIX) or handler is None:
            return handler
        metadata = dict(details.invocation_metadata or ())
        caller = self._keys.identify(metadata.get("authorization"))
        if caller is None:
            return self._refusals[(handler.request_streaming, handler.response_streaming)]
        # The call's own task runs the handler next, and no other call's: nothing to reset.
        _CALLER.set(caller)
        return handler


class ApiKeyMiddleware:
    """ASGI middleware answering 401 to HTTP requests and WebSocket handshakes without a valid key,
    except health's (and /metrics' unless `metrics_auth`). A response to a caller with limits
    carries OpenAI's x-ratelimit-* headers, from `rate_limits` as they stand when it starts."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics_auth: bool, rate_limits: RateLimiter | None = None) -> None:
        self._app = app
        self._keys = keys
        self._exempt = _HTTP_EXEMPT if metrics_auth else _HTTP_EXEMPT | {"/metrics"}
        self._rate_limits = rate_limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self._exempt:
            await self._app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope["headers"]}
        authorization = headers.get(b"authorization")
        caller = self._keys.identify(authorization.decode("latin-1") if authorization is not None else None)
        if caller is None:
            refusal = ApiError(401, "a valid API key is required: send `Authorization: Bearer <key>`",
                               "AuthenticationError").response()
            refusal.headers["WWW-Authenticate"] = "Bearer"
            await refusal(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start" and self._rate_limits is not None:
                status = self._rate_limits.status(caller)
                if status is not None:
                    message = {**message, "headers": [*message.get("headers", ()), *rate_limit_headers(status)]}
            await send(message)

        token = _CALLER.set(caller)
        try:
            await self._app(scope, receive, send_with_limits)
        finally:
            _CALLER.reset(token)
