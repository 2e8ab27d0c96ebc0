"""Streamed completions over a WebSocket: the POST endpoints' server-sent events, one message each.

One request a connection, at /v1/completions/ws or /v1/chat/completions/ws:

1. The client sends one message (text or binary): the JSON body the POST endpoint takes. `stream`
   is implied, whatever the body says, and the usage chunk is always sent.
2. The server sends each event of the stream as one text message, the JSON of the SSE `data:` lines,
   then the usage chunk (as `stream_options.include_usage` asks of SSE), then `{"type": "done"}`, and
   closes with 1000.
3. The client may send `{"type": "cancel"}` at any time: the request is cancelled on the workers, and
   the server answers `{"type": "cancelled"}` and closes with 1000. A client that closes the connection
   cancels its request too.

A body the API refuses gets the POST endpoint's error body (`{"error": {...}}`) and close 1008 (1009
when it is larger than max_body_bytes). A request that fails later gets its error body too, and close
1013 when it may succeed later (429, 503), 1008 when the request itself is at fault (another 4xx), 1011
otherwise. On a gateway with API keys the handshake needs the key (services.gateway.api_keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from services.gateway.openai_api.errors import ApiError, api_error
from services.gateway.openai_api.fanout import FanOut
from services.gateway.openai_api.http_limits import too_large
from services.gateway.openai_api.streaming import Job, event_json, reply_events
from services.gateway.service import GatewayService

Prepare = Callable[[bytes, str], Job]

# Close codes (RFC 6455): done or cancelled; the request refused; too large; failed, retry later; failed.
NORMAL, POLICY_VIOLATION, TOO_BIG, TRY_AGAIN_LATER, INTERNAL_ERROR = 1000, 1008, 1009, 1013, 1011


class CompletionSocket:
    """The WebSocket twin of one POST endpoint; `prepare(body, path)` turns a body into its Job,
    raising what the POST endpoint would answer."""

    def __init__(self, service: GatewayService, prepare: Prepare, max_body_bytes: int) -> None:
        self._service = service
        self._prepare = prepare
        self._max_body_bytes = max_body_bytes

    async def serve(self, websocket: WebSocket) -> None:
        """Answer one connection: one request, streamed."""
        await websocket.accept()
        # A client gone: its request, if it had begun, is cancelled already.
        with contextlib.suppress(WebSocketDisconnect):
            await self._serve(websocket)

    async def _serve(self, websocket: WebSocket) -> None:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        raw = message.get("bytes") or message.get("text", "").encode()
        if len(raw) > self._max_body_bytes:
            await _close(websocket, too_large(self._max_body_bytes).body(), TOO_BIG)
            return
        if _is_cancel(raw):
            await _close(websocket, {"type": "cancelled"}, NORMAL)
            return
        try:
            job = self._prepare(raw, websocket.url.path)
        except Exception as error:
            await _close(websocket, api_error(error).body(), POLICY_VIOLATION)
            return
        fan = FanOut(self._service, job.requests, job.target, job.body.n)
        streaming = asyncio.ensure_future(_stream(websocket, fan, job))
        listening = asyncio.ensure_future(_until_cancelled(websocket))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            await fan.close()  # cancels the requests still running, on their workers too
        if not streaming.cancelled():
            failure = streaming.exception()
            if failure is None:
                await _close(websocket, {"type": "done"}, NORMAL)
            elif not isinstance(failure, WebSocketDisconnect):
                error = api_error(failure)
                await _close(websocket, error.body(), _close_code(error))
        elif listening.result():
            await _close(websocket, {"type": "cancelled"}, NORMAL)


async def _stream(websocket: WebSocket, fan: FanOut, job: Job) -> None:
    async for event in reply_events(fan, job, include_usage=True):
        await websocket.send_text(event_json(event))


async def _until_cancelled(websocket: WebSocket) -> bool:
    """Read the client's messages until it cancels (True) or goes away (False); others are ignored."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return False
        if _is_cancel(message.get("bytes") or message.get("text", "").encode()):
            return True


def _is_cancel(raw: bytes) -> bool:
    try:
        return json.loads(raw) == {"type": "cancel"}
    except ValueError:
        return False


def _close_code(error: ApiError) -> int:
    if error.status in (429, 503):
        return TRY_AGAIN_LATER
    return POLICY_VIOLATION if 400 <= error.status < 500 else INTERNAL_ERROR


async def _close(websocket: WebSocket, data: dict[str, Any], code: int) -> None:
    """Send the last message, then close with `code`."""
    await websocket.send_text(event_json(data))
    await websocket.close(code)
