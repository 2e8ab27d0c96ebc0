"""How failures become gRPC statuses, the same way in every handler.

ValueError (the engine's and the converters' "bad input, naming the field") is INVALID_ARGUMENT,
TimeoutError is DEADLINE_EXCEEDED, the engine's LoRA refusals have theirs (`_LORA_CODES`), a role
worker's `WorkerError` maps its kind of failure to a code (the one place that does), a
`StatusError` carries its own code, anything else is INTERNAL (and logged with its traceback, since
it is a bug or an unexpected failure). The RPC's span, when traced, is marked failed with the
status code's name as its `error.type`. A StatusError's extra fields travel as trailing metadata
(`retry-after`, `tandem-failed-prefill`), and `status_error_from_rpc` reads them back on the
calling side.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import NoReturn

import grpc

from engine.lora.registry import AdapterInUse, AdapterMismatch, AdaptersBusy, LoraDisabled, UnknownAdapter
from services.common.failure import Failure, WorkerError
from services.observability.spans import set_error

log = logging.getLogger(__name__)


FAILED_PREFILL_KEY = "tandem-failed-prefill"

_FAILURE_CODES = {
    Failure.NO_ROOM: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Failure.CANCELLED: grpc.StatusCode.CANCELLED,
}

# A LoRA adapter not served (the API's 404), one in use that cannot be unloaded now (503), and an
# adapter served otherwise than the request needs or none at all (the worker is the wrong one).
_LORA_CODES = (
    (UnknownAdapter, grpc.StatusCode.NOT_FOUND),
    (AdapterInUse, grpc.StatusCode.UNAVAILABLE),
    (AdaptersBusy, grpc.StatusCode.UNAVAILABLE),
    (AdapterMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (LoraDisabled, grpc.StatusCode.FAILED_PRECONDITION),
)


class StatusError(Exception):
    """A failure with the gRPC status code to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 failed_prefill: str | None = None) -> None:
        """`retry_after_s`: when a refusal (RESOURCE_EXHAUSTED) is worth retrying; sent to gRPC
        clients as `retry-after` trailing metadata (whole seconds), to HTTP clients as Retry-After.
        `failed_prefill`: the prefill worker (host:port) whose failure, or whose KV transfer's,
        this is: the decode worker answering is fine, and the request may run again elsewhere."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.failed_prefill = failed_prefill


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a handler answers `exc` with."""
    if isinstance(exc, StatusError):
        return exc.code, exc.message
    if isinstance(exc, WorkerError):
        return _FAILURE_CODES[exc.failure], exc.message
    lora = next((code for kind, code in _LORA_CODES if isinstance(exc, kind)), None)
    if lora is not None:
        return lora, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException,
                     trailers: Sequence[tuple[str, str]] = ()) -> NoReturn:
    """End the RPC with the status `exc` maps to, and these `trailers` besides its own."""
    code, message = status_of(exc)
    set_error(code.name, message)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=exc)
    sent = list(trailers)
    if isinstance(exc, StatusError) and exc.retry_after_s is not None:
        sent.append(("retry-after", str(math.ceil(exc.retry_after_s))))
    if isinstance(exc, StatusError | WorkerError) and exc.failed_prefill is not None:
        sent.append((FAILED_PREFILL_KEY, exc.failed_prefill))
    await context.abort(code, message, trailing_metadata=tuple(sent))
    raise AssertionError("context.abort returned")  # it always raises; this tells type checkers


def status_error_from_rpc(error: grpc.aio.AioRpcError) -> StatusError:
    """A failed call as a StatusError: its code, details and the prefill worker it blames."""
    trailers = dict(error.trailing_metadata() or ())
    return StatusError(error.code(), error.details() or "", failed_prefill=trailers.get(FAILED_PREFILL_KEY))

