"""The benchmarks' OpenAI-API client: streamed `/v1/completions` with open-loop arrivals, each request
timed by its server-sent events.

Every request is sent at its scheduled time whether or not earlier ones have finished (open loop:
a slow server builds a queue instead of slowing the client down), streamed, and timed by its SSE
chunks: TTFT is the first chunk carrying text, TPOT is (last text chunk − first) / (tokens − 1),
with the token count from `usage` (`stream_options.include_usage`) or else the text chunks counted.
Times come from `clock` (seconds; `time.perf_counter` unless a test gives its own). The events are
read as the load clients' HTTP path reads them (harness/sse_events.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import httpx2

from bench.common.metrics import RequestResult, token_timing
from bench.common.workload import BenchRequest
from harness.sse_events import DONE, carries_text, event_data
from harness.token_timer import TokenTimer

Clock = Callable[[], float]


def request_body(model: str, request: BenchRequest, slo_ms: tuple[float, float] | None) -> dict:
    """The JSON body for one request: greedy, exactly `output_tokens` tokens (ignore_eos), streamed,
    with the first SLO as Tandem's per-request fields (other servers ignore unknown fields)."""
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if slo_ms is not None:  # whole milliseconds: Tandem's API takes integers
        body["ttft_ms"], body["tpot_ms"] = round(slo_ms[0]), round(slo_ms[1])
    return body


async def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id the server lists at /v1/models."""
    async with httpx2.AsyncClient(base_url=base_url, timeout=timeout_s) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def _one(client: httpx2.AsyncClient, body: dict, origin: float, clock: Clock) -> RequestResult:
    timer = TokenTimer(clock)
    sent = timer.started_at
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult(False, started_s=sent - origin, finished_s=clock() - origin,
                                     error=f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if (data := event_data(line)) is None or data == DONE:
                    continue
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if carries_text(chunk):
                    timer.add(1)
    except (httpx2.HTTPError, json.JSONDecodeError) as error:
        return RequestResult(False, started_s=sent - origin, finished_s=clock() - origin,
                             error=type(error).__name__)
    finished = clock()
    tokens = usage_tokens if usage_tokens is not None else timer.chunks
    if timer.first_at is None or timer.last_at is None or tokens != body["max_tokens"]:
        return RequestResult(False, started_s=sent - origin, finished_s=finished - origin,
                             error=f"{tokens} of {body['max_tokens']} tokens")
    ttft, tpot = token_timing(sent, timer.first_at, timer.last_at, tokens)
    return RequestResult(True, ttft, tpot, tokens, sent - origin, finished - origin)


async def run_open_loop(base_url: str, bodies: Sequence[dict], arrivals: Sequence[float],
                        request_timeout_s: float, clock: Clock = time.perf_counter) -> list[RequestResult]:
    """Send `bodies[i]` at `arrivals[i]` seconds from now, all concurrently; every result, in order.
    A request still running after `request_timeout_s` is abandoned and counted as failed."""
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(request_timeout_s, connect=30.0)
    async with httpx2.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        origin = clock()

        async def at(delay: float, body: dict) -> RequestResult:
            await asyncio.sleep(max(0.0, origin + delay - clock()))
            try:
                return await asyncio.wait_for(_one(client, body, origin, clock), request_timeout_s)
            except TimeoutError:
                now = clock() - origin
                return RequestResult(False, started_s=now - request_timeout_s, finished_s=now, error="timeout")

        return list(await asyncio.gather(*(at(t, b) for t, b in zip(arrivals, bodies, strict=True))))
