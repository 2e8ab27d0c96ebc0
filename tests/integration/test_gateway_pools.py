"""The gateway's registry with real workers joining and leaving at run time, as Kubernetes
discovery drives it: a worker removed mid-stream finishes that stream, gets no new request, and
its channel closes afterwards. The workers run as they do in a pod: listening on 0.0.0.0, the
decode worker advertising the address its peers reach it at."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from tandem.v1 import common_pb2, decode_pb2
from workers_util import start_worker

from engine.sampling_params import SamplingParams
from services.common.convert import sampling_params_to_proto
from services.gateway.router import NoWorkerError
from services.gateway.workers import WorkerRegistry, dispatched

COMMON = ["--host", "0.0.0.0", "--port", "0", "--threads", "1", "--kv-cache-mib", "64"]
DEADLINE_S = 60.0  # generous bound for conditions polled below; no test asserts elapsed time
MAX_TOKENS = 24


def _loopback(address: str) -> str:
    return "127.0.0.1:" + address.rpartition(":")[2]


@pytest.fixture(scope="module")
def workers():
    prefill = start_worker(["prefill", *COMMON])
    decode = start_worker(["decode", *COMMON, "--kv-backend", "grpc", "--advertise-host", "127.0.0.1"])
    yield _loopback(prefill.address), _loopback(decode.address)
    for worker in (decode, prefill):
        assert worker.stop() == 0, worker.log_tail()


def test_a_decode_worker_removed_mid_stream_finishes_it_then_closes(workers):
    prefill_address, decode_address = workers
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def scenario() -> list[common_pb2.TokenChunk]:
        registry = WorkerRegistry(retire_after_s=0)
        registry.start()
        registry.add("prefill", prefill_address)
        registry.add("decode", decode_address)
        assert await registry.wait_routable(DEADLINE_S)
        (decode,) = registry.decode_order()
        (prefill,) = registry.prefill_order()
        request = decode_pb2.DecodeRequest(prompt_token_ids=list(range(100, 160)),
                                           sampling=sampling_params_to_proto(params),
                                           prefill_address=prefill.address)
        chunks = []
        with dispatched(decode, prefill, len(request.prompt_token_ids)):
            async for chunk in decode.stub.Generate(request, timeout=120):
                if not chunks:
                    registry.remove("decode", decode_address)  # its pod turned not ready
                    with pytest.raises(NoWorkerError):
                        registry.decode_order()
                chunks.append(chunk)
        deadline = time.monotonic() + DEADLINE_S
        while decode.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
            assert time.monotonic() < deadline, "the removed worker's channel did not close"
            await asyncio.sleep(0.05)
        # It comes back (a new endpoint with the same address): a fresh worker, routable again.
        registry.add("decode", decode_address)
        assert await registry.wait_routable(DEADLINE_S)
        assert registry.decode_order()[0] is not decode
        await registry.close()
        return chunks

    chunks = asyncio.run(scenario())
    assert sum(len(chunk.token_ids) for chunk in chunks) == MAX_TOKENS
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
