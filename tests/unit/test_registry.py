"""The gateway's worker registry: what a placement counts against its workers (no processes: the
channels are opened but never used)."""

from __future__ import annotations

import asyncio

from tandem.v1 import common_pb2

from services.gateway.registry import WorkerRegistry


def test_a_decode_workers_view_names_the_shortest_output_streaming_from_it():
    async def scenario() -> None:
        registry = WorkerRegistry(prefill=["10.0.0.1:50061"], decode=["10.0.1.1:50071"])
        for worker in registry.workers:
            worker.serving = True
            worker.report = common_pb2.LoadReport(role=worker.role, total_kv_blocks=1000, free_kv_blocks=1000)
        _, decode = registry.workers

        def place(max_tokens: int):
            request = registry.route_request(list(range(32)), max_tokens=max_tokens)
            return registry.claim(request, registry.decide(request))

        long, short, other_short = place(200), place(40), place(40)
        assert decode.view().shortest_output_tokens == 40
        short.release()
        assert decode.view().shortest_output_tokens == 40, "another 40-token request still streams"
        other_short.release()
        assert decode.view().shortest_output_tokens == 200
        long.release()
        long.release()  # a second release changes nothing
        assert decode.view().shortest_output_tokens == 0
        await registry.close()

    asyncio.run(scenario())
