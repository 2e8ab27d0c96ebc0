"""A tiny OpenAI-style streaming server for `python -m bench goodput --smoke` and the client's tests:
it shows the benchmark's whole path (schedule, SSE parsing, SLO accounting, results, plot) without a
model.

It imitates a server with one prefill lane: requests queue for it and hold it `prefill_s` each,
then stream `max_tokens` chunks `tpot_s` apart, so TTFT attainment falls once the request rate
nears 1 / `prefill_s`. Those waits are `pause(seconds)`: real sleeps, unless a test passes a pause
that moves a fake clock instead. Only `/v1/models`, `/health` and streaming `/v1/completions` are
served.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub"


class _Handler(BaseHTTPRequestHandler):
    server: StubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the benchmark prints its own progress."""

    def do_GET(self) -> None:
        """`/v1/models` and `/health`."""
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/health":
            self._json({})
        else:
            self._json({"error": {"message": "not found"}}, HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        """Streaming `/v1/completions` only."""
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or not body.get("stream"):
            self._json({"error": {"message": "only streaming /v1/completions"}}, HTTPStatus.BAD_REQUEST)
            return
        with self.server.prefill_lane:
            self.server.pause(self.server.prefill_s)
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        tokens = int(body["max_tokens"])
        for index in range(tokens):
            if index:
                self.server.pause(self.server.tpot_s)
            self._event({"object": "text_completion", "model": MODEL,
                         "choices": [{"index": 0, "text": f" w{index}", "finish_reason": None}]})
        if body.get("stream_options", {}).get("include_usage"):
            self._event({"object": "text_completion", "model": MODEL, "choices": [],
                         "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _event(self, data: dict) -> None:
        self._chunk(f"data: {json.dumps(data)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _json(self, data: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class StubServer(ThreadingHTTPServer):
    """The stub on 127.0.0.1 (port 0 = a free one), served from a daemon thread once `start`ed."""

    daemon_threads = True

    def __init__(self, prefill_s: float, tpot_s: float, port: int = 0,
                 pause: Callable[[float], None] = time.sleep) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.prefill_s, self.tpot_s, self.pause = prefill_s, tpot_s, pause
        self.prefill_lane = threading.Lock()

    @property
    def url(self) -> str:
        """The base URL of its OpenAI API."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up mid-stream (a timed-out request, vLLM's client closing) is normal here."""

    def start(self) -> StubServer:
        """Serve in the background."""
        threading.Thread(target=self.serve_forever, name="sse-stub", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()
