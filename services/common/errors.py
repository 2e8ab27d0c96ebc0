"""How failures become gRPC statuses, the same way in every handler.

ValueError (the engine's and the converters' "bad input, naming the field") is INVALID_ARGUMENT,
TimeoutError is DEADLINE_EXCEEDED, a `StatusError` carries its own code, anything else is INTERNAL
(and logged with its traceback, since it is a bug or an unexpected failure). The RPC's span, when
traced, is marked failed with the status code's name as its `error.type`.
"""

from __future__ import annotations

import logging
import math
from typing import NoReturn

import grpc

from services.observability.spans import set_error

log = logging.getLogger(__name__)


class StatusError(Exception):
    """A failure with the gRPC status code to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        """`retry_after_s`: when a refusal (RESOURCE_EXHAUSTED) is worth retrying; sent to gRPC
        clients as `retry-after` trailing metadata (whole seconds), to HTTP clients as Retry-After."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a handler answers `exc` with."""
    if isinstance(exc, StatusError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the RPC with the status `exc` maps to."""
    code, message = status_of(exc)
    set_error(code.name, message)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=exc)
    retry_after = getattr(exc, "retry_after_s", None)
    trailers = (("retry-after", str(math.ceil(retry_after))),) if retry_after is not None else ()
    await context.abort(code, message, trailing_metadata=trailers)
    raise AssertionError("context.abort returned")  # it always raises; this tells type checkers
