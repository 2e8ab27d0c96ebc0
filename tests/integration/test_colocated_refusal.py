"""A colocated worker asked to compute a prompt for another worker while its own KV is taken refuses
at once (RESOURCE_EXHAUSTED naming it), instead of queueing the prompt behind blocks it may never
free in time: two colocated workers doing that for each other held each other's reservations until
the KV timeout (engine.scheduler.Scheduler.admit_export)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from tandem.v1 import decode_pb2, decode_pb2_grpc

from engine.sampling_params import SamplingParams
from harness.worker import start_worker
from services.common.convert import sampling_params_to_proto
from services.common.errors import status_error_from_rpc

# 16 blocks of 16 tokens each; a KV timeout far longer than the worker takes to refuse.
COLOCATED = ["worker", "--role", "colocated", "--port", "0", "--threads", "1", "--kv-cache-blocks", "16",
             "--block-size", "16", "--kv-timeout", "120"]
# The busy worker's own request decodes long enough to hold its blocks while the other asks (its
# finished blocks would be evictable, which counts as free); 250 tokens fit its 16 blocks.
OWN_TOKENS = 100


@pytest.fixture(scope="module")
def pair():
    workers = [start_worker(COLOCATED, wait=False) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    yield [str(worker.address) for worker in workers]
    for worker in workers:
        assert worker.stop() == 0, worker.log_tail()


def test_a_busy_colocated_worker_refuses_a_prompt_for_another_at_once(pair):
    site, busy = pair

    async def scenario() -> tuple[grpc.StatusCode, str | None, int]:
        async with grpc.aio.insecure_channel(site) as to_site, grpc.aio.insecure_channel(busy) as to_busy:
            # `busy` decodes a request of its own holding 10 of its 16 blocks (150 prompt tokens)...
            own = decode_pb2.DecodeRequest(request_id="own", prompt_token_ids=list(range(100, 250)),
                                           sampling=sampling_params_to_proto(
                                               SamplingParams(max_tokens=OWN_TOKENS, temperature=0.0, ignore_eos=True)))
            stream = decode_pb2_grpc.DecodeStub(to_busy).Generate(own, timeout=120)
            first = await stream.read()  # its prompt's blocks are held from here
            assert first.token_ids
            # ...and is asked to compute a 120-token prompt (8 blocks) that `site` is to decode.
            split = decode_pb2.DecodeRequest(request_id="split", prompt_token_ids=list(range(300, 420)),
                                             sampling=sampling_params_to_proto(
                                                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
                                             prefill_address=busy)
            try:
                async for _ in decode_pb2_grpc.DecodeStub(to_site).Generate(split, timeout=120):
                    pass
                refusal = None
            except grpc.aio.AioRpcError as error:
                refusal = status_error_from_rpc(error)
            own_tokens = len(first.token_ids)
            while (chunk := await stream.read()) is not grpc.aio.EOF:
                own_tokens += len(chunk.token_ids)
        assert refusal is not None, "the busy worker queued the prompt instead of refusing it"
        return refusal.code, refusal.failed_prefill, own_tokens

    code, blamed, own_tokens = asyncio.run(scenario())
    # Refused where it could not run now, which the gateway retries elsewhere; the busy worker's own
    # request is untouched.
    assert (code, blamed, own_tokens) == (grpc.StatusCode.RESOURCE_EXHAUSTED, busy, OWN_TOKENS)
