"""The OpenAI-compatible HTTP API as a Starlette app over the gateway's core.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
`stream`), their WebSocket twins /v1/completions/ws and /v1/chat/completions/ws (websocket.py),
GET /v1/models, PUT /v1/admin/models/{name}/split (admin.py), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (lora_admin.py), GET /health (200 once requests can
be served, else 503), GET /metrics (Prometheus text format). Limits (services.gateway.limits):
bodies beyond `max_body_bytes` get 413, requests beyond `max_concurrent_requests` in flight get
429 (see http_limits.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute

from services.common.errors import StatusError
from services.gateway.adapter_admin import AdapterAdmin
from services.gateway.api_keys import current_caller
from services.gateway.catalog import Target
from services.gateway.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from services.gateway.metrics import HTTP_CONCURRENCY
from services.gateway.model import ServedModel
from services.gateway.openai_api.admin import put_split
from services.gateway.openai_api.errors import ApiError, api_error, bad_request
from services.gateway.openai_api.fanout import FanOut
from services.gateway.openai_api.http_limits import ConcurrencyLimit, read_json_body
from services.gateway.openai_api.lora_admin import load_lora_adapter, unload_lora_adapter
from services.gateway.openai_api.params import (
    chat_prompt,
    chat_requests,
    chat_tools,
    completion_prompts,
    completion_requests,
    echoed_prompts,
    prediction_text,
    unknown_fields,
)
from services.gateway.openai_api.responses import ChatFormat, Choice, CompletionFormat, usage_body
from services.gateway.openai_api.schema import ChatBody, CompletionBody, SamplingBody
from services.gateway.openai_api.streaming import Job, event_json, reply_events
from services.gateway.openai_api.websocket import CompletionSocket
from services.gateway.request import CheckedPrompt, GenerateRequest, Prompt
from services.gateway.service import GatewayService
from services.gateway.tools.choice import ToolFlags

log = logging.getLogger(__name__)

# Names the model version that served a reply (NAME@VERSION, or the model's name), as the body's
# system_fingerprint does.
MODEL_VERSION_HEADER = "x-tandem-model-version"

Endpoint = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


def create_app(service: GatewayService, limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
               tool_flags: ToolFlags | None = None) -> Starlette:
    """The HTTP API over `service`, within `limits`' body size and requests in flight, serving tool
    calls as `tool_flags` say."""
    api = OpenAIApi(service, limits.max_body_bytes, tool_flags or ToolFlags())
    admin = AdapterAdmin(service.registry, service.adapters, service.served_catalog)
    completions_ws = CompletionSocket(service, api.completion_job, limits.max_body_bytes)
    chat_ws = CompletionSocket(service, api.chat_job, limits.max_body_bytes)

    def refused(message: str) -> None:
        service.refused(uuid.uuid4().hex, "RESOURCE_EXHAUSTED", message, HTTP_CONCURRENCY)

    return Starlette(
        routes=[
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            WebSocketRoute("/v1/completions/ws", completions_ws.serve),
            WebSocketRoute("/v1/chat/completions/ws", chat_ws.serve),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/admin/models/{name}/split", _answering_errors(functools.partial(put_split, service)),
                  methods=["PUT"]),
            Route("/v1/load_lora_adapter", _answering_errors(functools.partial(load_lora_adapter, admin)),
                  methods=["POST"]),
            Route("/v1/unload_lora_adapter", _answering_errors(functools.partial(unload_lora_adapter, admin)),
                  methods=["POST"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", functools.partial(metrics, service.metrics.registry), methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_exception},
        middleware=[Middleware(ConcurrencyLimit, limit=limits.max_concurrent_requests, on_refused=refused)],
    )


def _answering_errors(endpoint: Endpoint) -> Endpoint:
    """Answer any failure of the endpoint with an OpenAI-style error body."""

    @functools.wraps(endpoint)
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as error:
            return api_error(error).response()

    return wrapped


class OpenAIApi:
    """The endpoints, over one GatewayService."""

    def __init__(self, service: GatewayService, max_body_bytes: int, tool_flags: ToolFlags) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.tool_flags = tool_flags
        self.completions = _answering_errors(self._completions)
        self.chat_completions = _answering_errors(self._chat_completions)
        self.models = _answering_errors(self._models)

    def completion_job(self, raw: bytes, path: str) -> Job:
        """The job of a /v1/completions body (`path`: where it came, for the log); what the API
        answers a bad body with is raised."""
        body = CompletionBody.model_validate_json(raw)
        target = self._target(body, path)
        model = target.model
        given = completion_prompts(body)
        prompts = [_checked(model, prompt, "prompt") for prompt in given]
        reply_id = f"cmpl-{uuid.uuid4().hex}"
        requests = completion_requests(body, prompts, reply_id)
        reply = CompletionFormat(reply_id, target.answered_as, int(time.time()), model.tokenizer,
                                 body.logprobs is not None, target.fingerprint,
                                 echoed_prompts(body, given, model.tokenizer.decode))
        return Job(body, _callers(requests), reply, target)

    def chat_job(self, raw: bytes, path: str) -> Job:
        """The job of a /v1/chat/completions body, as `completion_job`."""
        body = ChatBody.model_validate_json(raw)
        target = self._target(body, path)
        model = target.model
        tools, described = chat_tools(body, self.tool_flags)
        prompt = _checked(model, chat_prompt(body, described), "messages")
        reply_id = f"chatcmpl-{uuid.uuid4().hex}"
        predicted = model.tokenizer.encode(prediction_text(body), add_special_tokens=False)
        requests = chat_requests(body, prompt, self.service.limits.total_tokens(model.max_model_len), reply_id,
                                 predicted, tools.constraint)
        reply = ChatFormat(reply_id, target.answered_as, int(time.time()), model.tokenizer, body.logprobs,
                           target.fingerprint, tools.parser)
        return Job(body, _callers(requests), reply, target)

    async def _completions(self, request: Request) -> Response:
        raw = await read_json_body(request, self.max_body_bytes)
        return await _reply(self.service, request, self.completion_job(raw, request.url.path))

    async def _chat_completions(self, request: Request) -> Response:
        raw = await read_json_body(request, self.max_body_bytes)
        return await _reply(self.service, request, self.chat_job(raw, request.url.path))

    async def _models(self, request: Request) -> Response:
        # OpenAI's shape, one entry a version: `id` is what a request's `model` takes for exactly
        # that version (NAME@VERSION in a repository), `root` the model's name; a LoRA adapter as
        # vLLM lists one: `root` its directory, `parent` its base.
        return JSONResponse({"object": "list", "data": [{
            "id": f"{listing.id}@{listing.version}" if listing.version else listing.id, "object": "model",
            "created": 0, "owned_by": "tandem", "root": listing.root or listing.id, "parent": listing.parent,
            "version": listing.version or None, "state": listing.state, "max_model_len": listing.max_model_len,
            **listing.formats,
        } for listing in self.service.models()]})

    async def health(self, request: Request) -> Response:
        """200 once the model is loaded and each pool has a serving worker; 503 before. The body
        names the prefix index routing uses ("exact" or "approximate", --prefix-index) and details
        each worker: its role, whether it is routed to, whether the exact prefix index uses its block
        events ("exact") or refuses them, and why ("approximate" with that index), and the blocks
        each of its tiers holds by the index; and each LoRA adapter not routed for a conflict, with
        why (services.gateway.adapters)."""
        return JSONResponse({"prefix_index": self.service.registry.prefix_index,
                             "workers": self.service.worker_health(),
                             "lora_adapter_conflicts": dict(self.service.adapters.table.conflicts)},
                            status_code=200 if self.service.ready() else 503)

    def _target(self, body: SamplingBody, path: str) -> Target:
        """The model version the body's `model` names for its caller; unknown fields are logged, and
        an OpenAI field this server refuses is a ValueError naming it."""
        unknown = unknown_fields(body)
        if unknown:
            log.warning("%s: ignoring unknown fields: %s", path, ", ".join(unknown))
        try:
            caller = current_caller()
            return self.service.resolve(body.model or "", body.user or (caller.name if caller is not None else None),
                                        caller)
        except StatusError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:
                raise ApiError(404, error.message, "NotFoundError", "model") from error
            raise


async def _reply(service: GatewayService, request: Request, job: Job) -> Response:
    """Run the job's requests on its model version and answer with JSON, or with events once every
    request has started. A client that disconnects before that cancels them."""
    fan = FanOut(service, job.requests, job.target, job.body.n)
    streaming = False
    headers = {MODEL_VERSION_HEADER: job.target.fingerprint}
    try:
        if job.body.stream:
            await _unless_disconnected(request, fan.started())
            streaming = True
            return StreamingResponse(_events(fan, job), media_type="text/event-stream", headers=headers)
        return JSONResponse(await _unless_disconnected(request, _complete(fan, job)), headers=headers)
    finally:
        if not streaming:
            await fan.close()


async def _complete(fan: FanOut, job: Job) -> dict[str, Any]:
    """The non-streaming reply body, once every request has finished."""
    accumulated = [Choice() for _ in job.requests]
    async for index, chunk in fan.chunks():
        accumulated[index].add(chunk)
    usages = [choice.usage for choice in accumulated if choice.usage is not None]
    return job.reply.complete(accumulated, usage_body(usages, job.body.n))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`; if the client disconnects first, `work` is cancelled and the answer
    (which nobody will read) is a 499."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)
    if working.cancelled():
        raise ApiError(499, "the client closed the connection", "ClientClosedRequest")
    return working.result()


async def _disconnected(request: Request) -> None:
    # The body has been read: what the server sends next is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(fan: FanOut, job: Job) -> AsyncIterator[str]:
    """The server-sent events of a streamed reply, ending `data: [DONE]`; a failure after the
    first event is sent as an error event."""
    try:
        async for event in reply_events(fan, job, job.body.include_usage):
            yield _event(event)
    except Exception as error:
        yield _event(api_error(error).body())
    finally:
        await fan.close()
    yield "data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> str:
    return f"data: {event_json(data)}\n\n"


def _callers(requests: list[GenerateRequest]) -> list[GenerateRequest]:
    """The requests as the caller's whose key the request came with: each choice counts as a request
    against the key's limits."""
    caller = current_caller()
    return [dataclasses.replace(one, caller=caller) for one in requests]


def _checked(model: ServedModel, prompt: Prompt, field: str) -> CheckedPrompt:
    """The prompt's token ids, checked here once for all its choices (the core takes them as they
    are); a 400 about `field` when it is unusable."""
    try:
        return model.checked_prompt(prompt)
    except ValueError as error:
        raise bad_request(str(error), field) from error


async def metrics(registry: CollectorRegistry, request: Request) -> Response:
    """The gateway's Prometheus metrics, in the text exposition format."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Unknown routes and methods get an OpenAI-style error body too."""
    assert isinstance(exc, HTTPException)
    type_ = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
    return ApiError(exc.status_code, exc.detail, type_).response()
