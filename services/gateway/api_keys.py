"""API keys at the gateway: every client route of both APIs asks for `Authorization: Bearer <key>`.

gRPC callers send it as `authorization` metadata (checked by `ApiKeyInterceptor`), HTTP callers as
a header (checked by `ApiKeyMiddleware`, which answers 401 with an OpenAI-style error body). Health
is always exempt (load balancers and probes hold no key); /metrics is exempt unless configured.
Keys come from a file (one a line) and/or `TANDEM_API_KEYS` (comma-separated); no keys = no check.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.openai_api.errors import ApiError

ENV_VAR = "TANDEM_API_KEYS"
_GRPC_EXEMPT_PREFIX = "/grpc.health.v1.Health/"
_HTTP_EXEMPT = frozenset({"/health"})
_BEARER = "bearer "


@dataclass(frozen=True)
class ApiKeys:
    """The keys a caller may present (never logged)."""

    keys: tuple[bytes, ...] = field(repr=False)

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("--api-key-file/TANDEM_API_KEYS: no key given")
        if any(not key or any(c in key for c in b" \t,") for key in self.keys):
            raise ValueError("--api-key-file/TANDEM_API_KEYS: a key is empty or holds whitespace or a comma")

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` value carries one of the keys. Every key is compared, in
        constant time and as digests of equal length, so the time taken tells nothing about which
        key matched, how much of it, or how long the keys are."""
        if authorization is None or authorization[:len(_BEARER)].lower() != _BEARER:
            return False
        given = hashlib.sha256(authorization[len(_BEARER):].strip().encode()).digest()
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given, hashlib.sha256(key).digest())
        return matched


def load_api_keys(key_file: Path | None, environ: dict[str, str] | None = None) -> ApiKeys | None:
    """The keys from `key_file` (one a line; blank lines and `#` comments skipped) and the
    environment's TANDEM_API_KEYS; None when neither gives any (the gateway then asks for none)."""
    environ = dict(os.environ) if environ is None else environ
    keys: list[str] = []
    if key_file is not None:
        try:
            lines = key_file.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {exc.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file: {key_file} holds no key")
    keys += [part.strip() for part in environ.get(ENV_VAR, "").split(",") if part.strip()]
    if not keys:
        return None
    return ApiKeys(tuple(dict.fromkeys(key.encode() for key in keys)))


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
        if self._keys.accepts(metadata.get("authorization")):
            return handler
        return self._refusals[(handler.request_streaming, handler.response_streaming)]


class ApiKeyMiddleware:
    """ASGI middleware answering 401 to HTTP requests and WebSocket handshakes without a valid key,
    except health's (and /metrics' unless `metrics_auth`)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics_auth: bool) -> None:
        self._app = app
        self._keys = keys
        self._exempt = _HTTP_EXEMPT if metrics_auth else _HTTP_EXEMPT | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self._exempt:
            await self._app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope["headers"]}
        authorization = headers.get(b"authorization")
        if self._keys.accepts(authorization.decode("latin-1") if authorization is not None else None):
            await self._app(scope, receive, send)
            return
        refusal = ApiError(401, "a valid API key is required: send `Authorization: Bearer <key>`",
                           "AuthenticationError").response()
        refusal.headers["WWW-Authenticate"] = "Bearer"
        await refusal(scope, receive, send)
