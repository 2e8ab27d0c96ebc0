"""A StatusError's (or a role worker's WorkerError's) extra fields cross a real gRPC call (loopback,
port 0) as trailing metadata and come back as the same fields: the retry hint, and the prefill worker
a decode worker blames. Each kind of WorkerError is answered with its own status code."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import StatusError, abort_with, status_error_from_rpc
from services.common.failure import Failure, WorkerError

METHOD = "/tandem.test.Failing/Fail"


async def _round_trip(raised: Exception) -> StatusError:
    async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await abort_with(context, raised)

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(fail)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.test.Failing", {"Fail": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await channel.unary_unary(METHOD)(b"", timeout=30)
        return status_error_from_rpc(failure.value)
    finally:
        await server.stop(None)


def test_the_blamed_prefill_worker_comes_back_with_code_and_message() -> None:
    raised = StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "KV not complete", failed_prefill="10.0.0.7:50061")
    got = asyncio.run(_round_trip(raised))
    assert (got.code, got.message, got.failed_prefill) == (
        grpc.StatusCode.DEADLINE_EXCEEDED, "KV not complete", "10.0.0.7:50061")


def test_errors_that_blame_no_worker_come_back_without_one() -> None:
    for raised in (StatusError(grpc.StatusCode.UNAVAILABLE, "draining"), ValueError("max_tokens: too big")):
        got = asyncio.run(_round_trip(raised))
        assert got.failed_prefill is None and got.code in (grpc.StatusCode.UNAVAILABLE,
                                                           grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize(("failure", "code"), [
    (Failure.NO_ROOM, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Failure.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (Failure.DEADLINE, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Failure.MISMATCH, grpc.StatusCode.FAILED_PRECONDITION),
    (Failure.CANCELLED, grpc.StatusCode.CANCELLED),
])
def test_a_worker_failure_is_answered_with_its_code_and_its_blame(failure: Failure, code: grpc.StatusCode) -> None:
    got = asyncio.run(_round_trip(WorkerError(failure, "it failed").blaming("10.0.0.7:50061")))
    assert (got.code, got.message, got.failed_prefill) == (code, "it failed", "10.0.0.7:50061")
    assert asyncio.run(_round_trip(WorkerError(failure, "it failed"))).failed_prefill is None
