"""Generate calls to a gateway's core through its real gRPC edge (GatewayServicer behind
ApiKeyInterceptor) on loopback, in process: what each call ended with."""

from __future__ import annotations

import grpc
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

from services.gateway.api_keys import ApiKeyInterceptor, ApiKeys
from services.gateway.handler import GatewayServicer
from services.gateway.service import GatewayService


async def generate_failures(service: GatewayService, keys: ApiKeys,
                            calls: list[tuple[str, gateway_pb2.GenerateRequest]]) -> list[grpc.aio.AioRpcError | None]:
    """Each call (the key's secret, the request) in turn: the error it ended with, None if none."""
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(service), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    failures: list[grpc.aio.AioRpcError | None] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for secret, request in calls:
                call = stub.Generate(request, timeout=30, metadata=(("authorization", f"Bearer {secret}"),))
                try:
                    async for _ in call:
                        pass
                    failures.append(None)
                except grpc.aio.AioRpcError as error:
                    failures.append(error)
    finally:
        await server.stop(None)
    return failures
