"""The HTTP listener's drain waits for requests, not for TLS goodbyes: a finished wss session whose
client keeps its socket open does not hold the drain for the grace period (the TLS close_notify
exchange would, for asyncio's 30 s SSL shutdown timeout)."""

from __future__ import annotations

import asyncio
import time

import websocket
from certs import TestCa
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from services.common.http_server import HttpListener

GRACE_S = 30.0


async def _one_message(socket: WebSocket) -> None:
    await socket.accept()
    await socket.send_text("hello")
    await socket.close()


def test_a_finished_wss_session_does_not_hold_the_drain(tmp_path):
    ca = TestCa(tmp_path / "ca", "drain test CA")
    issued = ca.issue("gateway")
    app = Starlette(routes=[WebSocketRoute("/ws", _one_message)])

    async def scenario() -> float:
        listener = HttpListener(app, "127.0.0.1", 0, {"ssl_certfile": str(issued.cert_file),
                                                      "ssl_keyfile": str(issued.key_file)})
        address = await listener.start()

        def session() -> websocket.WebSocket:
            client = websocket.create_connection(f"wss://{address}/ws", timeout=10,
                                                 sslopt={"ca_certs": str(ca.cert_file)})
            assert [*iter(client.recv, "")] == ["hello"]
            return client  # its socket stays open, as a client that is slow to close leaves it

        client = await asyncio.to_thread(session)
        started = time.monotonic()
        await listener.stop(GRACE_S)
        elapsed = time.monotonic() - started
        client.sock and client.sock.close()
        return elapsed

    elapsed = asyncio.run(scenario())
    assert elapsed < GRACE_S / 3, f"the drain waited {elapsed:.1f} s for a finished session"
