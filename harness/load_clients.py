"""Clients that load a gateway the way real ones do, for the storm, overload and soak runs.

One `LoadRequest` runs as one streamed call through the gateway's gRPC API (`TandemClient`) or its
HTTP API (server-sent events from `/v1/completions`, read with `http.client`), and may be cancelled
by the client at a chosen time or after a chosen number of chunks: a gRPC call is cancelled, an HTTP
connection is closed. Each call ends as an `Outcome` saying what the client saw.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from harness.sse_events import DONE, carries_text, event_data
from harness.token_timer import TokenTimer
from services.client import TandemClient

GRPC, HTTP = "grpc", "http"
OK, CANCELLED, REFUSED, ERROR = "ok", "cancelled", "refused", "error"
CALL_TIMEOUT_S = 300.0  # every call ends by itself: no load here can hang a run
TOKEN_RANGE = (1000, 30000)  # ordinary text tokens of the shipped model's vocabulary


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """`count` random ordinary token ids (prompts that share nothing unless built to)."""
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


@dataclass(frozen=True)
class LoadRequest:
    """One greedy request of exactly `max_tokens` tokens (EOS ignored), and when its client gives up:
    `cancel_after_s` after the call started, or once `cancel_after_chunks` chunks carried tokens."""

    token_ids: tuple[int, ...]
    max_tokens: int
    api: str = GRPC
    cancel_after_s: float | None = None
    cancel_after_chunks: int | None = None
    ttft_ms: int = 0  # 0: the gateway's objectives
    tpot_ms: int = 0


@dataclass(frozen=True)
class Outcome:
    """What the client saw. `status`: OK (the stream ended normally), CANCELLED (the client gave up
    first), REFUSED (RESOURCE_EXHAUSTED / HTTP 429, with the retry-after hint) or ERROR."""

    request: LoadRequest
    status: str
    tokens: int = 0
    started_at: float = 0.0  # time.monotonic() when the call was sent
    ttft_s: float | None = None  # to the first chunk with tokens
    tpot_s: float | None = None  # mean time per token after the first (None for fewer than 2)
    retry_after_s: float | None = None
    detail: str = ""


def _outcome(clock: TokenTimer, request: LoadRequest, status: str, **extra: object) -> Outcome:
    return Outcome(request, status, clock.tokens, clock.started_at, clock.ttft_s, clock.tpot_s, **extra)


def run_grpc(client: TandemClient, request: LoadRequest) -> Outcome:
    """Run `request` through the gateway's gRPC API."""
    clock = TokenTimer(time.monotonic)
    stream = client.generate(token_ids=list(request.token_ids), max_tokens=request.max_tokens, temperature=0.0,
                             ignore_eos=True, ttft_ms=request.ttft_ms, tpot_ms=request.tpot_ms,
                             timeout=CALL_TIMEOUT_S)
    gave_up = threading.Event()

    def give_up() -> None:
        gave_up.set()
        stream.cancel()

    timer = _timer(request.cancel_after_s, give_up)
    try:
        for chunk in stream:
            clock.add(len(chunk.token_ids))
            if chunk.token_ids and clock.chunks == request.cancel_after_chunks and chunk.finish_reason is None:
                give_up()
    except grpc.RpcError as error:
        if gave_up.is_set() and error.code() == grpc.StatusCode.CANCELLED:
            return _outcome(clock, request, CANCELLED)
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            retry_after = dict(error.trailing_metadata() or ()).get("retry-after")
            return _outcome(clock, request, REFUSED, retry_after_s=_seconds(retry_after), detail=error.details())
        return _outcome(clock, request, ERROR, detail=f"{error.code().name}: {error.details()}")
    finally:
        if timer is not None:
            timer.cancel()
    return _outcome(clock, request, OK)


def run_http(address: str, request: LoadRequest) -> Outcome:
    """Run `request` as a streamed `/v1/completions` call to the gateway's HTTP API at host:port;
    giving up closes the connection, as a client that goes away does."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
    body = {"prompt": list(request.token_ids), "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    body |= {key: value for key, value in (("ttft_ms", request.ttft_ms), ("tpot_ms", request.tpot_ms)) if value}
    gave_up = threading.Event()
    connection.connect()
    sock = connection.sock

    def give_up() -> None:
        gave_up.set()
        # Wakes the reading thread at once: the server sees the connection close. (The call may
        # have ended and closed the socket just before.)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    clock = TokenTimer(time.monotonic)
    timer = _timer(request.cancel_after_s, give_up)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")
            if response.status == 429:
                return _outcome(clock, request, REFUSED, retry_after_s=_seconds(response.getheader("Retry-After")),
                                     detail=text)
            return _outcome(clock, request, ERROR, detail=f"HTTP {response.status}: {text}")
        completion_tokens = None
        for event in _events(response):
            if "error" in event:
                return _outcome(clock, request, ERROR, detail=json.dumps(event["error"]))
            if event.get("usage"):
                completion_tokens = event["usage"]["completion_tokens"]
            # An event carries a chunk's text; its token count is known only from the usage at the end.
            if carries_text(event):
                clock.add(1)
                if clock.chunks == request.cancel_after_chunks:
                    give_up()
        if completion_tokens is None:
            raise OSError("the stream ended without its usage event")
        clock.tokens = completion_tokens
        return _outcome(clock, request, OK)
    except (OSError, http.client.HTTPException) as error:
        if gave_up.is_set():
            return _outcome(clock, request, CANCELLED)
        return _outcome(clock, request, ERROR, detail=repr(error))
    finally:
        if timer is not None:
            timer.cancel()
        connection.close()


def _events(response: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON events of a server-sent event stream, up to `data: [DONE]`."""
    for raw in response:
        data = event_data(raw.decode())
        if data is None:
            continue
        if data == DONE:
            return
        yield json.loads(data)
    raise OSError("the stream ended before data: [DONE]")


def _timer(delay_s: float | None, action: Callable[[], None]) -> threading.Timer | None:
    if delay_s is None:
        return None
    timer = threading.Timer(delay_s, action)
    timer.daemon = True
    timer.start()
    return timer


def _seconds(value: str | None) -> float | None:
    return float(value) if value else None


class LoadRunner:
    """Runs requests against one gateway (its gRPC address and its HTTP host:port)."""

    def __init__(self, grpc_address: str, http_address: str) -> None:
        self.http_address = http_address
        self.client = TandemClient(grpc_address)

    def run(self, request: LoadRequest) -> Outcome:
        """One request, through the API it names."""
        if request.api == GRPC:
            return run_grpc(self.client, request)
        return run_http(self.http_address, request)

    def run_all(self, requests: Sequence[LoadRequest], concurrency: int) -> list[Outcome]:
        """Every request, at most `concurrency` at a time, in the order given; outcomes in that order."""
        with ThreadPoolExecutor(max(1, min(concurrency, len(requests)))) as pool:
            return list(pool.map(self.run, requests))

    def run_at(self, schedule: Iterable[tuple[float, LoadRequest]], max_in_flight: int = 256) -> list[Outcome]:
        """Open loop: each request sent at its offset (seconds from now, ascending) whatever the others
        do, unless `max_in_flight` calls are still running (then it waits for one to end)."""
        start = time.monotonic()
        with ThreadPoolExecutor(max_in_flight) as pool:
            futures = []
            for offset, request in schedule:
                time.sleep(max(0.0, start + offset - time.monotonic()))
                futures.append(pool.submit(self.run, request))
            return [future.result() for future in futures]

    def close(self) -> None:
        """Close the gRPC connection."""
        self.client.close()

    def __enter__(self) -> LoadRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
