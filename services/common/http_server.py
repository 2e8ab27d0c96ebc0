"""An ASGI app served by uvicorn on the running event loop, beside a process's gRPC server.

The process's RoleServer owns the signals and the drain: uvicorn's own signal handling is
turned off, and `stop` is called during the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import uvicorn
from starlette.types import ASGIApp

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers, which would replace the RoleServer's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpListener:
    """Serves an ASGI app on host:port (port 0 picks a free one), started and stopped by a RoleServer."""

    name = "http"

    def __init__(self, app: ASGIApp, host: str, port: int, ssl: Mapping[str, Any] | None = None) -> None:
        """`ssl`: uvicorn.Config's ssl_* arguments to serve HTTPS (see services.common.tls)."""
        self.host = host
        self.port = port
        # WebSockets through wsproto, which answers a refused handshake with the app's own HTTP
        # response (an API key's 401, a 429), as the HTTP routes answer.
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, ws="wsproto",
                                **(ssl or {}))
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        """host:port actually bound (valid once started)."""
        return f"{self.host}:{self.port}"

    async def start(self) -> str:
        """Bind and begin serving; the address bound. OSError when the port is taken."""
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((self.host, self.port), family=family)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {self.address} stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP listening on %s", self.address)
        return self.address

    async def stop(self, grace_period: float) -> None:
        """Stop accepting connections; give open requests `grace_period` seconds, then cancel them."""
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_period
        self._server.should_exit = True
        # uvicorn waits until every connection is gone. A TLS connection whose exchange is over (a
        # finished wss session, a response sent) is gone only once the peer answers its close_notify,
        # which a client keeping its socket open never does: asyncio then waits its 30 s SSL shutdown
        # timeout, holding the drain. Such a transport, closing with nothing left to send, is cut instead.
        while not self._task.done():
            for connection in list(self._server.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None and transport.is_closing() and not transport.get_write_buffer_size():
                    transport.abort()
            await asyncio.wait({self._task}, timeout=0.1)
        self._task.result()
