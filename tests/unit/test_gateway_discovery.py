"""Kubernetes discovery: EndpointSlices -> addresses, list + watch with resource versions, re-list
on 410 Gone, backoff on errors, and the registry's pools following the result.

No Kubernetes API server can run here: the list/watch tests drive the real `kubernetes` client
against `fake_kube_api.FakeKubeApi`, a local HTTP server implementing those endpoints.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest
from fake_kube_api import FakeKubeApi
from kubernetes import client

from services.gateway.discovery import Backoff, KubernetesDiscovery, ServiceEndpoints, ready_addresses, sync_pool
from services.gateway.registry import WorkerRegistry
from services.gateway.tpot_slack import DecodeProgress

SLICES = "/apis/discovery.k8s.io/v1/namespaces/tandem/endpointslices"


def endpoint_slice(endpoints: list[tuple[str, bool | None]], ports: list[tuple[str | None, int]]):
    return client.V1EndpointSlice(
        address_type="IPv4",
        metadata=client.V1ObjectMeta(name="s"),
        endpoints=[client.V1Endpoint(addresses=[address], conditions=client.V1EndpointConditions(ready=ready))
                   for address, ready in endpoints],
        ports=[client.DiscoveryV1EndpointPort(name=name, port=port) for name, port in ports],
    )


def test_only_ready_endpoints_count_and_an_unset_condition_means_ready():
    sliced = endpoint_slice([("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)], [("grpc", 50061)])
    assert ready_addresses(sliced, "grpc") == {"10.0.0.1:50061", "10.0.0.3:50061"}


def test_the_named_port_is_used_and_ipv6_hosts_are_bracketed():
    sliced = endpoint_slice([("fd00::7", True)], [("metrics", 9090), ("grpc", 50071)])
    assert ready_addresses(sliced, "grpc") == {"[fd00::7]:50071"}
    assert ready_addresses(endpoint_slice([("10.0.0.1", True)], [(None, 1234)]), "grpc") == {"10.0.0.1:1234"}
    assert ready_addresses(endpoint_slice([("10.0.0.1", True)], [("http", 80)]), "grpc") == set()


def test_backoff_doubles_up_to_its_cap_and_resets():
    backoff = Backoff(initial_s=1, maximum_s=5)
    assert [backoff.next_delay() for _ in range(5)] == [1, 2, 4, 5, 5]
    backoff.reset()
    assert backoff.next_delay() == 1
    with pytest.raises(ValueError):
        Backoff(initial_s=2, maximum_s=1)


class RecordingBackoff(Backoff):
    """A short backoff that remembers the delays it handed out."""

    def __init__(self) -> None:
        super().__init__(initial_s=0.01, maximum_s=0.04)
        self.delays: list[float] = []

    def next_delay(self) -> float:
        delay = super().next_delay()
        self.delays.append(delay)
        return delay


class Watched:
    """A ServiceEndpoints on its own thread against the fake API, publishing into a queue."""

    def __init__(self, api: FakeKubeApi, service: str = "tandem-prefill") -> None:
        self.backoff = RecordingBackoff()
        self.published: queue.Queue[set[str]] = queue.Queue()
        discovery = client.DiscoveryV1Api(client.ApiClient(api.configuration()))
        self.endpoints = ServiceEndpoints(discovery, "tandem", service, "grpc", self.published.put,
                                          backoff=self.backoff, watch_timeout_s=5)
        self.thread = threading.Thread(target=self.endpoints.run, daemon=True)
        self.thread.start()

    def next(self, timeout: float = 30.0) -> set[str]:
        return self.published.get(timeout=timeout)

    def stop(self) -> None:
        self.endpoints.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture
def api():
    fake = FakeKubeApi()
    yield fake
    fake.close()


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_list_then_watch_follows_adds_readiness_and_deletes(api):
    api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.1", True), ("10.0.0.2", False)], 50061)
    api.put_slice("decode-a", "tandem-decode", [("10.0.1.1", True)], 50071)
    listed_at = str(api.resource_version)
    watched = Watched(api)
    try:
        assert watched.next() == {"10.0.0.1:50061"}
        wait_for(lambda: api.count("GET", SLICES, watch="true", resourceVersion=listed_at) == 1)
        api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.1", True), ("10.0.0.2", True)], 50061)
        assert watched.next() == {"10.0.0.1:50061", "10.0.0.2:50061"}
        api.put_slice("prefill-b", "tandem-prefill", [("10.0.0.3", True)], 50061)
        assert watched.next() == {"10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"}
        # A terminating pod turns not ready before its endpoint goes: it is dropped at once.
        api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.1", False), ("10.0.0.2", True)], 50061)
        assert watched.next() == {"10.0.0.2:50061", "10.0.0.3:50061"}
        api.delete_slice("prefill-b")
        assert watched.next() == {"10.0.0.2:50061"}
        # The other Service's slices are never seen.
        api.put_slice("decode-a", "tandem-decode", [("10.0.1.1", True), ("10.0.1.2", True)], 50071)
        api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.9", True)], 50061)
        assert watched.next() == {"10.0.0.9:50061"}
        assert watched.backoff.delays == []
    finally:
        watched.stop()


def test_a_410_gone_relists_at_once_and_watches_from_the_new_version(api):
    api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.1", True)], 50061)
    watched = Watched(api)
    try:
        assert watched.next() == {"10.0.0.1:50061"}
        api.expire_watches()
        # A change made while the watch is expired is still found, by the new list.
        api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.2", True)], 50061)
        assert watched.next() == {"10.0.0.2:50061"}
        wait_for(lambda: api.count("GET", SLICES, watch="true", resourceVersion=str(api.resource_version)) == 1)
        assert api.count("GET", SLICES) - api.count("GET", SLICES, watch="true") == 2
        assert watched.backoff.delays == [], "410 Gone is not an error: no backoff"
        api.put_slice("prefill-b", "tandem-prefill", [("10.0.0.3", True)], 50061)
        assert watched.next() == {"10.0.0.2:50061", "10.0.0.3:50061"}
    finally:
        watched.stop()


def test_api_errors_back_off_exponentially_then_recover(api):
    api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.1", True)], 50061)
    api.failures_to_inject = 4
    watched = Watched(api)
    try:
        assert watched.next() == {"10.0.0.1:50061"}
        assert watched.backoff.delays == [0.01, 0.02, 0.04, 0.04]
        # The successful list reset the backoff: the next failure (the resumed watch) waits 0.01 s.
        api.failures_to_inject = 1
        api.expire_watches()
        api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.2", True)], 50061)
        assert watched.next() == {"10.0.0.2:50061"}
        assert watched.backoff.delays[4:] == [0.01]
    finally:
        watched.stop()


class HeldSleeps:
    """The registry's sleeps, each returning only when the test ends it."""

    def __init__(self) -> None:
        self._started: asyncio.Queue[tuple[float, asyncio.Future[None]]] = asyncio.Queue()

    async def __call__(self, seconds: float) -> None:
        ended = asyncio.get_running_loop().create_future()
        self._started.put_nowait((seconds, ended))
        await ended

    async def next(self) -> tuple[float, asyncio.Future[None]]:
        """The next sleep the registry starts (waiting for it to start): its seconds, and a future
        whose result ends it."""
        return await asyncio.wait_for(self._started.get(), 30)


async def closed(worker) -> None:
    """Wait (with a generous deadline) until the worker's channel is shut down."""
    deadline = time.monotonic() + 30
    while worker.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
        assert time.monotonic() < deadline, f"{worker.address}: channel still open"
        await asyncio.sleep(0.05)


def test_a_removed_idle_worker_keeps_its_channel_for_requests_that_ranked_it_before():
    async def scenario() -> None:
        sleeps = HeldSleeps()
        registry = WorkerRegistry(decode=["127.0.0.1:1"], retire_after_s=0.5, sleep=sleeps)
        (worker,) = registry.workers
        registry.remove("decode", "127.0.0.1:1")
        seconds, retirement = await sleeps.next()
        assert seconds == 0.5 and worker.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN
        retirement.set_result(None)
        await closed(worker)
        await registry.close()

    asyncio.run(scenario())


def test_sync_pool_adds_new_workers_and_drains_removed_ones_after_their_streams():
    async def scenario() -> None:
        sleeps = HeldSleeps()
        registry = WorkerRegistry(retire_after_s=0.2, sleep=sleeps)
        sync_pool(registry, "decode", {"127.0.0.1:1", "127.0.0.1:2"})
        assert registry.addresses("decode") == {"127.0.0.1:1", "127.0.0.1:2"}
        (busy,) = [worker for worker in registry.workers if worker.address == "127.0.0.1:1"]
        stream = DecodeProgress(max_tokens=16, tpot_objective_s=0.1)
        busy.decoding.add(stream)  # a stream the gateway is relaying from it
        sync_pool(registry, "decode", {"127.0.0.1:2", "127.0.0.1:3"})
        assert registry.addresses("decode") == {"127.0.0.1:2", "127.0.0.1:3"}
        assert busy not in registry.workers, "a removed worker gets no new requests"
        seconds, retirement = await sleeps.next()
        assert seconds == 0.2
        retirement.set_result(None)  # its retirement delay is over
        _, poll = await sleeps.next()  # but its stream still runs
        assert busy.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN, "its stream still runs"
        busy.decoding.discard(stream)
        poll.set_result(None)
        await closed(busy)
        await registry.close()

    asyncio.run(scenario())


def test_closing_the_registry_closes_workers_still_draining():
    async def scenario() -> None:
        registry = WorkerRegistry(decode=["127.0.0.1:1"], retire_after_s=0)
        (worker,) = registry.workers
        worker.decoding.add(DecodeProgress(max_tokens=16, tpot_objective_s=0.1))
        registry.remove("decode", "127.0.0.1:1")
        await registry.close()
        assert worker.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN

    asyncio.run(scenario())


def test_discovery_keeps_both_registry_pools_equal_to_their_services(api):
    async def scenario() -> None:
        registry = WorkerRegistry()
        discovery = KubernetesDiscovery(registry, client.DiscoveryV1Api(client.ApiClient(api.configuration())),
                                        "tandem", {"prefill": "tandem-prefill", "decode": "tandem-decode"})
        api.put_slice("prefill-a", "tandem-prefill", [("10.0.0.1", True)], 50061)
        discovery.start()

        async def until(role, addresses) -> None:
            deadline = time.monotonic() + 30
            while registry.addresses(role) != addresses:
                assert time.monotonic() < deadline, (role, registry.addresses(role))
                await asyncio.sleep(0.02)

        await until("prefill", {"10.0.0.1:50061"})
        api.put_slice("decode-a", "tandem-decode", [("10.0.1.1", True), ("10.0.1.2", True)], 50071)
        await until("decode", {"10.0.1.1:50071", "10.0.1.2:50071"})
        api.put_slice("decode-a", "tandem-decode", [("10.0.1.2", True)], 50071)
        await until("decode", {"10.0.1.2:50071"})
        assert registry.addresses("prefill") == {"10.0.0.1:50061"}
        discovery.stop()
        await registry.close()

    asyncio.run(scenario())
