"""The gateway with real workers joining and leaving at run time, as Kubernetes discovery drives
it: a worker removed mid-stream finishes that stream, gets no new request, and its channel closes
afterwards; a `tandem gateway --discovery kubernetes --planner apply` process finds the workers
and scales the pools. The workers run as they do in a pod: listening on 0.0.0.0, the decode worker
advertising the address its peers reach it at.

No Kubernetes API server can run here: the gateway process talks to `fake_kube_api.FakeKubeApi`,
a local HTTP stand-in for the endpoints it uses, through a kubeconfig that points there.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from fake_kube_api import FakeKubeApi
from tandem.v1 import common_pb2, decode_pb2

from engine.sampling_params import SamplingParams
from harness.worker import start_worker
from services.client import TandemClient
from services.common.convert import sampling_params_to_proto
from services.gateway.registry import WorkerRegistry
from services.gateway.router import NoWorkerError

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
        prompt = list(range(100, 160))
        routed = registry.route_request(prompt, MAX_TOKENS)
        placement = registry.claim(routed, registry.decide(routed))
        decode, prefill = placement.decode, placement.prefill
        assert prefill is not None
        request = decode_pb2.DecodeRequest(prompt_token_ids=prompt,
                                           sampling=sampling_params_to_proto(params),
                                           prefill_address=prefill.address)
        chunks = []
        try:
            async for chunk in decode.stub.Generate(request, timeout=120):
                if not chunks:
                    registry.remove("decode", decode_address)  # its pod turned not ready
                    with pytest.raises(NoWorkerError):
                        registry.decide(routed)
                chunks.append(chunk)
        finally:
            placement.release()
        deadline = time.monotonic() + DEADLINE_S
        while decode.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
            assert time.monotonic() < deadline, "the removed worker's channel did not close"
            await asyncio.sleep(0.05)
        # It comes back (a new endpoint with the same address): a fresh worker, routable again.
        registry.add("decode", decode_address)
        assert await registry.wait_routable(DEADLINE_S)
        again = registry.claim(routed, registry.decide(routed))
        assert again.decode is not decode and again.decode.address == decode_address
        again.release()
        await registry.close()
        return chunks

    chunks = asyncio.run(scenario())
    assert sum(len(chunk.token_ids) for chunk in chunks) == MAX_TOKENS
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def _kubeconfig(api: FakeKubeApi, path) -> str:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{api.configuration().host}'}}}}]\n"
        "users: [{name: fake, user: {token: fake}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake, namespace: tandem}}]\n"
    )
    return str(path)


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _text(client: TandemClient) -> list:
    """The chunks of a short greedy completion through the gateway."""
    return list(client.generate(prompt="The capital of France is", max_tokens=4, temperature=0.0, timeout=120))


def test_gateway_process_discovers_the_pools_and_its_planner_scales_them(workers, tmp_path, monkeypatch):
    prefill_address, decode_address = workers
    api = FakeKubeApi()
    api.replicas.update({"tandem-prefill": 3, "tandem-decode": 3})
    api.put_slice("prefill-1", "tandem-prefill", [("127.0.0.1", True)], _port(prefill_address))
    api.put_slice("decode-1", "tandem-decode", [("127.0.0.1", True)], _port(decode_address))
    monkeypatch.setenv("KUBECONFIG", _kubeconfig(api, tmp_path / "kubeconfig"))
    gateway = start_worker(["gateway", "--port", "0", "--discovery", "kubernetes", "--k8s-namespace", "tandem",
                            "--planner", "apply", "--planner-interval", "0.5", "--scale-down-window", "0",
                            "--scale-cooldown", "0"])
    try:
        with TandemClient(gateway.address) as client:
            assert _text(client)[-1].finish_reason == "length"
            # Idle pools need the minimum, one replica each; the planner (the Lease's holder) sets it.
            deadline = time.monotonic() + DEADLINE_S
            while api.replicas != {"tandem-prefill": 1, "tandem-decode": 1}:
                assert time.monotonic() < deadline, (api.replicas, gateway.log_tail())
                time.sleep(0.1)
            assert api.leases["tandem-planner"]["spec"]["holderIdentity"]
            # The decode pod turns not ready: no decode worker is left to route to.
            api.put_slice("decode-1", "tandem-decode", [("127.0.0.1", False)], _port(decode_address))
            deadline = time.monotonic() + DEADLINE_S
            while True:
                try:
                    _text(client)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                    break
                assert time.monotonic() < deadline, "the unready decode worker is still routed to"
                time.sleep(0.1)
            # Ready again: routed to again once its health and load streams are back.
            api.put_slice("decode-1", "tandem-decode", [("127.0.0.1", True)], _port(decode_address))
            deadline = time.monotonic() + DEADLINE_S
            while True:
                try:
                    assert _text(client)[-1].finish_reason == "length"
                    break
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "the decode worker was not routed to again"
                    time.sleep(0.1)
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
        api.close()
