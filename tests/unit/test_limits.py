"""The configurable limits: their validation, their flags, and their effect on real gRPC servers
on loopback (message size, streams per connection, requests that do not parse)."""

from __future__ import annotations

import argparse
import asyncio
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import build_parser
from services.common.config_flags import from_args
from services.common.grpc_limits import GrpcLimits
from services.common.server import HealthService, channel_options, server_options
from services.common.undecodable import DecodeErrorInterceptor
from services.gateway.limits import RequestLimits


@pytest.mark.parametrize(("fields", "words"), [
    ({"max_message_bytes": 0}, "max_message_bytes: must be in [1, 2^31)"),
    ({"max_concurrent_streams": 2**31}, "max_concurrent_streams: must be in [1, 2^31)"),
])
def test_grpc_limits_are_validated(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        GrpcLimits(**fields)


@pytest.mark.parametrize(("fields", "words"), [
    ({"max_prompt_tokens": 0}, "max_prompt_tokens: must be >= 1"),
    ({"max_body_bytes": -1}, "max_body_bytes: must be >= 1"),
    ({"max_prompt_tokens": 64, "max_total_tokens": 64}, "max_prompt_tokens: must be below max_total_tokens=64"),
])
def test_request_limits_are_validated(fields, words):
    with pytest.raises(ValueError, match=words):
        RequestLimits(**fields)


def test_token_limits_name_the_field_and_the_limit():
    limits = RequestLimits(max_prompt_tokens=100, max_total_tokens=150)
    limits.check(100, 50, max_model_len=8192)
    with pytest.raises(ValueError, match=r"^prompt: 101 tokens exceed the limit of 100 prompt tokens"):
        limits.check(101, 1, max_model_len=8192)
    with pytest.raises(ValueError, match=r"^max_tokens: 51 .* of 150 total tokens \(max_total_tokens\); at most 50$"):
        limits.check(100, 51, max_model_len=8192)
    # The model's context bounds every request too, whatever the limits say.
    assert RequestLimits().total_tokens(2048) == 2048 and limits.total_tokens(100) == 100
    with pytest.raises(ValueError, match=r"^prompt: 2048 tokens leave no room .* 2048 total tokens \(max_model_len\)"):
        RequestLimits().check(2048, None, max_model_len=2048)
    with pytest.raises(ValueError, match=r"^max_tokens: 2000 .* \(max_model_len\); at most 1048$"):
        RequestLimits().check(1000, 2000, max_model_len=2048)


def grpc_limits(args: argparse.Namespace) -> GrpcLimits:
    return from_args(GrpcLimits, args)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return from_args(RequestLimits, args)


def test_the_flags_translate_into_limits_and_errors_name_the_flag():
    parser = build_parser()
    args = parser.parse_args(["gateway", "--max-prompt-tokens", "10", "--max-total-tokens", "20",
                              "--max-body-bytes", "1000", "--max-concurrent-requests", "3",
                              "--max-message-bytes", "4096", "--max-concurrent-streams", "7"])
    assert request_limits(args) == RequestLimits(10, 20, 1000, 3)
    assert grpc_limits(args) == GrpcLimits(4096, 7)
    assert request_limits(parser.parse_args(["gateway"])) == RequestLimits()
    with pytest.raises(ValueError, match=r"^--max-concurrent-streams: must be in"):
        grpc_limits(parser.parse_args(["prefill", "--max-concurrent-streams", "0"]))
    with pytest.raises(ValueError, match=r"^--max-prompt-tokens: must be below max_total_tokens=20"):
        request_limits(parser.parse_args(["gateway", "--max-prompt-tokens", "30", "--max-total-tokens", "20"]))


def test_options_carry_the_limits():
    limits = GrpcLimits(4096, 7)
    assert ("grpc.max_receive_message_length", 4096) in channel_options(limits)
    assert ("grpc.max_send_message_length", 4096) in channel_options(limits)
    assert ("grpc.max_concurrent_streams", 7) in server_options(limits)


async def _health_server(limits: GrpcLimits) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=server_options(limits), interceptors=[DecodeErrorInterceptor()])
    health = HealthService([])
    health.set_serving(True)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_a_message_over_the_limit_is_resource_exhausted():
    async def check() -> grpc.StatusCode:
        server, address = await _health_server(GrpcLimits(max_message_bytes=1024))
        try:
            async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Check(health_pb2.HealthCheckRequest(service="x" * 2048), timeout=10)
                return refused.value.code()
        finally:
            await server.stop(None)

    assert asyncio.run(check()) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_calls_beyond_the_streams_per_connection_wait_for_a_free_stream():
    async def check() -> None:
        server, address = await _health_server(GrpcLimits(max_concurrent_streams=1))
        try:
            async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watch = stub.Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                # The connection's one stream is the open Watch: a second call waits, here past its deadline.
                with pytest.raises(grpc.aio.AioRpcError) as waited:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                watch.cancel()
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(check())


def test_a_request_that_does_not_parse_is_invalid_argument_naming_the_field():
    async def check(raw: bytes) -> tuple[grpc.StatusCode, str]:
        server, address = await _health_server(GrpcLimits())
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                check_call = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                                                 response_deserializer=health_pb2.HealthCheckResponse.FromString)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await check_call(raw, timeout=10)
                return refused.value.code(), refused.value.details()
        finally:
            await server.stop(None)

    bad_utf8 = health_pb2.HealthCheckRequest(service="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    assert asyncio.run(check(bad_utf8)) == (grpc.StatusCode.INVALID_ARGUMENT, "service: is not valid UTF-8")
    code, details = asyncio.run(check(b"\x0a\x05ab"))  # a string field longer than the bytes left
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("request: does not parse as grpc.health.v1.HealthCheckRequest")
