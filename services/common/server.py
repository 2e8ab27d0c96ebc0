"""The gRPC bootstrap every Tandem process shares (gateway, prefill and decode workers).

A `RoleServer` owns one grpc.aio server and its life:

1. `add(...)` the role's servicers (before `run`; a grpc.aio server takes no services once started);
2. `listen(...)` other listeners to serve beside gRPC (e.g. the gateway's HTTP API);
3. `run(load, close)` binds host:port (port 0 picks a free one, see `address`), starts serving at once
   with every service NOT_SERVING in grpc.health.v1 (and the listeners started), awaits `load()`
   (e.g. the model, in a thread), turns SERVING, and prints the ready line
   `tandem <role> ready grpc=HOST:PORT` on stdout, followed by ` metrics=HOST:PORT` when
   `metrics_address` is set (the process's Prometheus endpoint) and ` NAME=HOST:PORT` per listener;
4. on SIGTERM or SIGINT it drains: health NOT_SERVING, `draining` set (long-lived streams such as
   WatchLoad and health Watch end), new RPCs refused with UNAVAILABLE, in-flight RPCs (and the
   listeners' requests) given `grace_period` seconds, then `close()`; `run` returns the exit code
   (0 after a drain).

Every client channel should use `channel_options()`: its keep-alive pings match what the server
accepts, so idle connections survive and dead peers are detected on both ends, and its message sizes
are the process's `GrpcLimits` (services.common.grpc_limits), as its server's are.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.grpc_limits import DEFAULT_GRPC_LIMITS, GrpcLimits
from services.common.undecodable import DecodeErrorInterceptor

log = logging.getLogger(__name__)

S = TypeVar("S")

# Clients ping an idle connection every 20 s and give up after 10 s without an answer. The server
# accepts pings twice as often and never answers ping "abuse" with GOAWAY "too_many_pings": the
# clients are our own, and such a GOAWAY would end long token streams (BDP probes count as pings).
_KEEPALIVE_TIME_MS = 20_000
_KEEPALIVE_TIMEOUT_MS = 10_000

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def channel_options(limits: GrpcLimits = DEFAULT_GRPC_LIMITS) -> list[tuple[str, Any]]:
    """Options for every client channel to a Tandem server: keep-alive matched to `server_options`,
    message sizes from `limits`."""
    return [
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        *limits.channel_options(),
    ]


def server_options(limits: GrpcLimits = DEFAULT_GRPC_LIMITS) -> list[tuple[str, Any]]:
    """Options of every Tandem server: keep-alive matched to `channel_options`, message sizes and
    streams per connection from `limits`, no port sharing."""
    return [
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.max_pings_without_data", 0),
        *limits.server_options(),
        # gRPC sets SO_REUSEPORT by default: a second server on a taken port would bind silently.
        ("grpc.so_reuseport", 0),
    ]


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: Check and Watch, per service name ("" = the whole server).

    Unlike the stock servicer, Watch streams end once the server drains (after telling the watcher
    NOT_SERVING), so a watching gateway does not hold the drain for the whole grace period.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._status = {name: _NOT_SERVING for name in ("", *names)}
        self._changed = asyncio.Event()
        self._draining = False

    def set_serving(self, serving: bool) -> None:
        """Mark every service SERVING or NOT_SERVING."""
        for name in self._status:
            self._status[name] = _SERVING if serving else _NOT_SERVING
        self._notify()

    def drain(self) -> None:
        """NOT_SERVING for good; Watch streams end after reporting it."""
        self._draining = True
        self.set_serving(False)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, _UNKNOWN)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self._draining:
                return
            await changed.wait()


class Listener(Protocol):
    """Something a RoleServer serves beside gRPC, e.g. services.common.http_server.HttpListener."""

    name: str  # its key in the ready line

    async def start(self) -> str:
        """Bind and begin serving; the HOST:PORT bound."""
        ...

    async def stop(self, grace_period: float) -> None:
        """Stop accepting; give open requests `grace_period` seconds."""
        ...


class RoleServer:
    """One process's grpc.aio server: health, reflection, the ready line and the graceful drain.

    Create it inside the running event loop (grpc.aio binds the server to it).
    """

    def __init__(
        self,
        role: str,
        host: str = "127.0.0.1",
        port: int = 0,
        grace_period: float = 30.0,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        limits: GrpcLimits = DEFAULT_GRPC_LIMITS,
        advertise_host: str | None = None,
    ) -> None:
        """`credentials`: serve TLS (see services.common.tls), else plaintext; `interceptors` see
        every RPC first (e.g. the gateway's API-key check); `limits`: message sizes and streams per
        connection; `advertise_host`: the address others reach it at, which `address` and the ready
        line name (default `host`; set it when `host` is a wildcard such as 0.0.0.0). A request that
        does not parse gets INVALID_ARGUMENT (services.common.undecodable)."""
        self.role = role
        self.host = host
        self.advertise_host = advertise_host or host
        self.port = port
        self.grace_period = grace_period
        # Last, so that it wraps the servicers' own handlers: a request that does not parse is bad input.
        self.grpc = grpc.aio.server(options=server_options(limits),
                                    interceptors=[*interceptors, DecodeErrorInterceptor()])
        self._credentials = credentials
        self.draining = asyncio.Event()
        self.metrics_address: str | None = None
        self._names: list[str] = []
        self._listeners: list[Listener] = []
        self._stop = asyncio.Event()  # set by a signal or by `fail`
        self._loop = asyncio.get_running_loop()
        self._failure: str | None = None

    def fail(self, reason: str) -> None:
        """Stop serving for good because the worker can no longer compute (callable from any
        thread): health NOT_SERVING, the drain, then `run` returns exit code 1."""
        log.critical("%s: stopping: %s", self.role, reason)
        self._failure = reason
        self._loop.call_soon_threadsafe(self._stop.set)

    @property
    def address(self) -> str:
        """advertise_host:port, the port actually bound (valid once `run` has bound it)."""
        return f"{self.advertise_host}:{self.port}"

    def add(self, add_to_server: Callable[[S, grpc.aio.Server], None], servicer: S, full_name: str) -> None:
        """Register a servicer with its generated `add_XServicer_to_server` function and its full
        service name (e.g. "tandem.v1.Prefill", for health and reflection)."""
        add_to_server(servicer, self.grpc)
        self._names.append(full_name)

    def listen(self, listener: Listener) -> None:
        """Serve `listener` beside gRPC, for the same life (before `run`)."""
        self._listeners.append(listener)

    async def run(
        self,
        load: Callable[[], Awaitable[None]] | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> int:
        """Serve until SIGTERM/SIGINT and return the exit code: 0 after a drain, 1 if `load` failed or
        `fail` was called.

        `load` runs after the port is bound and the server started (so health answers NOT_SERVING
        while it runs); `close` runs after the drain, once no RPC is left.
        """
        health = HealthService(self._names)
        health_pb2_grpc.add_HealthServicer_to_server(health, self.grpc)
        reflection.enable_server_reflection(
            [*self._names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.grpc,
        )
        bind = f"{self.host}:{self.port}"
        if self._credentials is None:
            self.port = self.grpc.add_insecure_port(bind)
        else:
            self.port = self.grpc.add_secure_port(bind, self._credentials)
        stop, loop = self._stop, self._loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.grpc.start()
        listening = "".join([f" {listener.name}={await listener.start()}" for listener in self._listeners])
        log.info("%s: gRPC listening on %s:%d; loading", self.role, self.host, self.port)
        code = 0
        if await self._load(load, stop):
            health.set_serving(True)
            metrics = f" metrics={self.metrics_address}" if self.metrics_address else ""
            print(f"tandem {self.role} ready grpc={self.address}{metrics}{listening}", flush=True)
            log.info("%s: serving on %s", self.role, self.address)
            await stop.wait()
            code = 0 if self._failure is None else 1
        elif not stop.is_set():
            code = 1
        await self._drain(health)
        if close is not None:
            await close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("%s: stopped", self.role)
        return code

    async def _load(self, load: Callable[[], Awaitable[None]] | None, stop: asyncio.Event) -> bool:
        """True once loaded; False if loading failed or a signal came first."""
        if load is None:
            return True
        loading = asyncio.ensure_future(load())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not loading.done():
            # A model load in a thread cannot be interrupted; let it end so `close` sees a consistent state.
            log.info("%s: signal while loading; stopping once the load ends", self.role)
            await asyncio.wait({loading})
            return False
        if loading.exception() is not None:
            log.error("%s: loading failed", self.role, exc_info=loading.exception())
            return False
        return True

    async def _drain(self, health: HealthService) -> None:
        log.info("%s: draining (grace period %.1f s)", self.role, self.grace_period)
        health.drain()
        self.draining.set()
        # Stops accepting RPCs now (callers get UNAVAILABLE) and cancels what is left after the grace.
        await asyncio.gather(self.grpc.stop(self.grace_period),
                             *(listener.stop(self.grace_period) for listener in self._listeners))


def exit_process(code: int) -> NoReturn:
    """End a worker process right after its drain and close, skipping interpreter teardown.

    A gloo pair thread still blocked in C++ when Python finalizes makes the process abort
    (std::terminate, exit code -6) even though every request was finished and every pair was
    asked to close; once the worker has drained there is nothing left that teardown must do.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
