"""Failures as OpenAI-style error bodies, with the HTTP status codes vLLM uses.

    {"error": {"message": ..., "type": ..., "param": ..., "code": <HTTP status>}}

Every failure goes through the project's gRPC status mapping first (services.common.errors), so
the same failure has the same meaning on both APIs.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

import grpc
from pydantic import ValidationError
from starlette.responses import JSONResponse

from services.common.errors import status_of

log = logging.getLogger(__name__)

# Seconds a client should wait after a 429 before it retries, when admission gave no hint.
RETRY_AFTER_S = 1

_HTTP_OF_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "BadRequestError"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "PermissionDeniedError"),
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError"),
}
_INTERNAL = (500, "InternalServerError")
# Validation messages start with the field they are about: "temperature: must be in [0, 100], got 200.0".
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.]*): ")


class ApiError(Exception):
    """A failure with its HTTP status, error type and the body field it is about."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        """The HTTP response; a 429 carries a Retry-After hint."""
        retry_after = math.ceil(self.retry_after_s) if self.retry_after_s is not None else RETRY_AFTER_S
        headers = {"Retry-After": str(retry_after)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(exc: Exception) -> ApiError:
    """The ApiError answering any failure: a body that did not validate, a StatusError of the
    core, a ValueError naming a field, or anything else (500, logged)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return _validation_error(exc)
    code, message = status_of(exc)
    status, type_ = _HTTP_OF_STATUS.get(code, _INTERNAL)
    if status == 500:
        log.error("internal error", exc_info=exc)
    match = _FIELD_PREFIX.match(message)
    param = match.group(1) if match else ("model" if status == 404 else None)
    return ApiError(status, message, type_, param, getattr(exc, "retry_after_s", None))


def bad_request(message: str, param: str | None) -> ApiError:
    """A 400 about one field of the body."""
    return ApiError(400, message, "BadRequestError", param)


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first['msg']}", None)
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request(f"the body must be a JSON object, got {json.dumps(first['input'])[:64]}", None)
    path = ".".join(str(part) for part in first["loc"])
    return bad_request(f"{path}: {first['msg']}", str(first["loc"][0]) if first["loc"] else None)
