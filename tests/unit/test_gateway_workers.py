"""The gateway's handle on a worker (services.gateway.workers.RemoteWorker) against a worker's RPCs
served on loopback: which of its load reports the gateway takes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc
from tandem.v1 import common_pb2, decode_pb2_grpc

from services.common.server import HealthService
from services.gateway.registry import WorkerRegistry


class ScriptedLoad(decode_pb2_grpc.DecodeServicer):
    """WatchLoad streams whatever report the test puts in `reports`, when it puts it."""

    def __init__(self) -> None:
        self.reports: asyncio.Queue[common_pb2.LoadReport] = asyncio.Queue()

    async def WatchLoad(self, request: common_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext):
        while True:
            yield await self.reports.get()


async def _until(predicate: Callable[[], bool], changed: asyncio.Event) -> None:
    """Wait for the registry's change notifications until `predicate` holds (generous deadline)."""
    async with asyncio.timeout(30):
        while not predicate():
            await changed.wait()
            changed.clear()


def test_a_load_report_without_block_size_is_refused_until_one_carries_it(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        load, health = ScriptedLoad(), HealthService([])
        decode_pb2_grpc.add_DecodeServicer_to_server(load, server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        health.set_serving(True)
        registry = WorkerRegistry(colocated=[f"127.0.0.1:{port}"])
        changed = asyncio.Event()
        registry.on_change(changed.set)
        registry.start()
        (worker,) = registry.workers
        try:
            await _until(lambda: worker.serving, changed)
            await load.reports.put(common_pb2.LoadReport(role="colocated", total_kv_blocks=100, free_kv_blocks=100))
            await _until(lambda: "without block_size refused" in caplog.text, changed)
            assert worker.report is None and worker.view() is None and not registry.routable()

            await load.reports.put(common_pb2.LoadReport(role="colocated", total_kv_blocks=100, free_kv_blocks=100,
                                                         block_size=16))
            await _until(lambda: worker.report is not None, changed)
            view = worker.view()
            assert view is not None and view.block_size == 16 and registry.routable()
        finally:
            await registry.close()
            await server.stop(None)

    with caplog.at_level(logging.INFO, logger="services.gateway.workers"):
        asyncio.run(scenario())
    assert [r.levelname for r in caplog.records if "block_size" in r.getMessage()] == ["WARNING", "INFO"]
