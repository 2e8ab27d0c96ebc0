"""A streamed reply's events, the same whether they go out as server-sent events or WebSocket messages."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.chunk import Usage
from services.gateway.catalog import Target
from services.gateway.openai_api.fanout import FanOut
from services.gateway.openai_api.responses import ReplyFormat, usage_body
from services.gateway.openai_api.schema import SamplingBody
from services.gateway.request import GenerateRequest


@dataclass(frozen=True)
class Job:
    """A request body as the core's requests (its choices, prompt-major), the model version they run
    on, and the format of their reply."""

    body: SamplingBody
    requests: Sequence[GenerateRequest]
    reply: ReplyFormat
    target: Target  # the model version every request runs on


async def reply_events(fan: FanOut, job: Job, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """The events of a streamed reply: the opening ones, one for each chunk that carries anything, and
    with `include_usage` a last one with the usage of every choice. A failure is raised to the caller."""
    usages: dict[int, Usage] = {}
    for event in job.reply.opening(len(job.requests)):
        yield event
    async for index, chunk in fan.chunks():
        if chunk.usage is not None:
            usages[index] = chunk.usage
        # Tokens held back (a partial character, a possible stop string, a tool call's start) send nothing yet.
        if chunk.text or chunk.logprobs or chunk.finish_reason:
            event = job.reply.delta(index, chunk)
            if event is not None:
                yield event
    if include_usage:
        yield job.reply.usage(usage_body([usages[index] for index in sorted(usages)], job.body.n))


def event_json(data: dict[str, Any]) -> str:
    """An event's JSON text, as every stream sends it."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
