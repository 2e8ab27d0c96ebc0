"""Kubernetes discovery: keep the registry's pools equal to the ready endpoints of the pools' Services.

Each pool is watched through the EndpointSlices of its (headless) Service: list them, then watch
from the list's resourceVersion; when the watch ends it resumes from the last version seen, when
the API answers 410 Gone (the version is too old) it lists again, and on any other error it waits
an exponentially growing backoff before listing again. Endpoints that are not ready (starting, or
terminating and draining) are left out, so a pod on its way out stops getting new requests while
the registry lets its in-flight streams finish.

The `kubernetes` client is synchronous: each pool's watch runs on its own daemon thread and hands
every change of address set to the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from services.gateway.registry import WorkerRegistry
from services.gateway.router import Role

log = logging.getLogger(__name__)

_GONE = 410
_WATCH_TIMEOUT_S = 240


class Backoff:
    """Exponential delays between failed attempts: initial, x factor each failure, capped."""

    def __init__(self, initial_s: float = 0.5, maximum_s: float = 30.0, factor: float = 2.0) -> None:
        if not 0 < initial_s <= maximum_s or factor < 1:
            raise ValueError("backoff: need 0 < initial_s <= maximum_s and factor >= 1")
        self._initial = initial_s
        self._maximum = maximum_s
        self._factor = factor
        self._next = initial_s

    def next_delay(self) -> float:
        """The delay before the next attempt (each call grows the one after)."""
        delay = self._next
        self._next = min(self._next * self._factor, self._maximum)
        return delay

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits the initial delay again."""
        self._next = self._initial


def ready_addresses(endpoint_slice: client.V1EndpointSlice, port_name: str) -> set[str]:
    """`host:port` of every ready endpoint of a slice, on its port named `port_name` (or its only
    port when that one has no name). A missing `ready` condition counts as ready, as the API says."""
    ports = [port for port in endpoint_slice.ports or [] if port.name == port_name or port.name is None]
    if len(ports) != 1 or ports[0].port is None:
        return set()
    port = ports[0].port
    addresses = set()
    for endpoint in endpoint_slice.endpoints or []:
        conditions = endpoint.conditions
        if conditions is not None and conditions.ready is False:
            continue
        for host in endpoint.addresses:
            addresses.add(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return addresses


class ServiceEndpoints:
    """The ready endpoints of one Service, kept current by list + watch of its EndpointSlices."""

    def __init__(self, api: client.DiscoveryV1Api, namespace: str, service: str, port_name: str,
                 publish: Callable[[set[str]], None], backoff: Backoff | None = None,
                 watch_timeout_s: int = _WATCH_TIMEOUT_S) -> None:
        """`publish` gets the full address set after the first list and after each change."""
        self._api = api
        self._namespace = namespace
        self._selector = f"kubernetes.io/service-name={service}"
        self._port_name = port_name
        self._publish = publish
        self._backoff = backoff or Backoff()
        self._watch_timeout_s = watch_timeout_s
        self._slices: dict[str, set[str]] = {}
        self._published: set[str] | None = None
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None

    def run(self) -> None:
        """List and watch until `stop`; errors are logged and retried, never raised."""
        while not self._stopped.is_set():
            try:
                self._watch_from(self._list())
            except ApiException as error:
                if error.status == _GONE:
                    log.info("endpoints of %s: watch expired (410 Gone); listing again", self._selector)
                    continue
                self._wait_after(error)
            except Exception as error:  # a dead watch thread would freeze the pool: log, back off, retry
                self._wait_after(error)

    def stop(self) -> None:
        """End `run` (an open watch is cut)."""
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def _list(self) -> str:
        listed = self._api.list_namespaced_endpoint_slice(self._namespace, label_selector=self._selector)
        self._slices = {item.metadata.name: ready_addresses(item, self._port_name) for item in listed.items}
        self._changed()
        self._backoff.reset()
        return listed.metadata.resource_version

    def _watch_from(self, resource_version: str) -> None:
        while not self._stopped.is_set():
            self._watch = watch.Watch()
            for event in self._watch.stream(
                self._api.list_namespaced_endpoint_slice, self._namespace, label_selector=self._selector,
                resource_version=resource_version, timeout_seconds=self._watch_timeout_s,
                allow_watch_bookmarks=True,
            ):
                self._apply(event["type"], event["object"])
            resource_version = self._watch.resource_version or resource_version

    def _apply(self, kind: str, endpoint_slice: client.V1EndpointSlice) -> None:
        if kind == "BOOKMARK":
            return
        name = endpoint_slice.metadata.name
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = ready_addresses(endpoint_slice, self._port_name)
        self._changed()

    def _changed(self) -> None:
        if self._stopped.is_set():
            return
        addresses = set().union(*self._slices.values())
        if addresses != self._published:
            self._published = addresses
            self._publish(addresses)

    def _wait_after(self, error: Exception) -> None:
        delay = self._backoff.next_delay()
        log.warning("endpoints of %s: %s; listing again in %.1f s", self._selector, error, delay)
        self._stopped.wait(delay)


class KubernetesDiscovery:
    """Both pools of a registry, each following its Service's ready endpoints."""

    def __init__(self, registry: WorkerRegistry, api: client.DiscoveryV1Api, namespace: str,
                 services: dict[Role, str], port_name: str = "grpc") -> None:
        self._registry = registry
        self._watches = {
            role: ServiceEndpoints(api, namespace, service, port_name, self._publisher(role))
            for role, service in services.items()
        }
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start watching (each pool on its own thread); changes reach the registry on this event loop."""
        self._loop = asyncio.get_running_loop()
        for role, endpoints in self._watches.items():
            threading.Thread(target=endpoints.run, name=f"discovery-{role}", daemon=True).start()

    def stop(self) -> None:
        """Stop watching; the registry keeps the workers it has."""
        for endpoints in self._watches.values():
            endpoints.stop()

    def _publisher(self, role: Role) -> Callable[[set[str]], None]:
        def publish(addresses: set[str]) -> None:
            assert self._loop is not None
            # The loop closes when the gateway stops; a watch may still be finishing then.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(sync_pool, self._registry, role, addresses)
        return publish


def sync_pool(registry: WorkerRegistry, role: Role, addresses: set[str]) -> None:
    """Make a registry pool exactly `addresses`: add the new ones, remove (drain) the others."""
    current = registry.addresses(role)
    for address in sorted(addresses - current):
        log.info("discovery: %s worker %s added", role, address)
        registry.add(role, address)
    for address in sorted(current - addresses):
        log.info("discovery: %s worker %s removed; draining", role, address)
        registry.remove(role, address)
