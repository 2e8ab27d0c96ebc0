"""The Gateway gRPC service: tandem.v1.Gateway messages to and from the gateway's core."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

import grpc
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

from services.common.convert import chunk_to_proto, sampling_params_from_proto
from services.common.errors import StatusError, abort_with
from services.gateway.api_keys import current_caller
from services.gateway.caller import Caller
from services.gateway.request import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    Prompt,
    RequestedSlo,
    TextPrompt,
    TokenPrompt,
    ToolCall,
)
from services.gateway.service import GatewayService
from services.gateway.tools.choice import Tool, ToolFlags, ToolUse, checked_tools, tool_use
from services.gateway.tools.stream import call_id

# Names the model version that served a Generate call (NAME@VERSION, or the model's name).
MODEL_VERSION_TRAILER = "tandem-model-version"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """tandem.v1.Gateway over a GatewayService."""

    def __init__(self, service: GatewayService, tool_flags: ToolFlags | None = None) -> None:
        self.service = service
        self.tool_flags = tool_flags or ToolFlags()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        try:
            listings = self.service.models()
        except StatusError as error:
            await abort_with(context, error)
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.Model(id=listing.id, max_model_len=listing.max_model_len, version=listing.version,
                              state=listing.state, dtype=listing.formats["dtype"] or "",
                              quantization=listing.formats["quantization"] or "",
                              kv_cache_dtype=listing.formats["kv_cache_dtype"] or "",
                              parent=listing.parent or "")
            for listing in listings
        ])

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            core_request, tools = generate_request_from_proto(request, current_caller(), self.tool_flags)
        except ValueError as error:
            self.service.refused(request.request_id, "INVALID_ARGUMENT", str(error))
            await abort_with(context, error)
        trailers: list[tuple[str, str]] = []
        text = ""
        try:
            target = self.service.target_for(core_request)
            trailers.append((MODEL_VERSION_TRAILER, target.fingerprint))
            async for chunk in self.service.generate(core_request, deadline, target):
                response = gateway_pb2.GenerateResponse(request_id=chunk.request_id, chunk=chunk_to_proto(chunk))
                if tools.parser is not None:
                    text += chunk.text
                    if chunk.finish_reason is not None:
                        reading = tools.parser.read(text, final=True)
                        response.content = reading.content or ""
                        response.tool_calls.extend(gateway_pb2.ToolCall(id=call_id(), name=call.name,
                                                                        arguments=call.arguments)
                                                   for call in reading.calls)
                yield response
        except (StatusError, ValueError) as error:
            await abort_with(context, error, [*trailers, *self._rate_limits(core_request)])
        context.set_trailing_metadata((*trailers, *self._rate_limits(core_request)))

    def _rate_limits(self, request: GenerateRequest) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* fields for the request's key as its limits stand now (none for a
        key without limits), sent as trailers as the HTTP API sends them as headers."""
        status = self.service.rate_limits.status(request.caller)
        return status.fields() if status is not None else []


def generate_request_from_proto(msg: gateway_pb2.GenerateRequest, caller: Caller | None = None,
                                tool_flags: ToolFlags | None = None) -> tuple[GenerateRequest, ToolUse]:
    """The core's request for a GenerateRequest sent with `caller`'s key, and how its tools shape
    the reply (services.gateway.tools.choice); ValueError naming the field when it is unusable."""
    try:
        sampling = sampling_params_from_proto(msg.sampling)
    except ValueError as error:
        raise ValueError(f"sampling.{error}") from error
    if sampling.lora_name:
        # The gateway sets it from `model`, where the key's models and the adapter's workers are checked.
        raise ValueError("sampling.lora_name: name a LoRA adapter by `model`; the gateway sets this field")
    described = _tools_from_proto(msg)
    tools = _tool_use_from_proto(msg, described, tool_flags or ToolFlags())
    if tools.constraint is not None:
        if sampling.structured is not None:
            raise ValueError("tool_choice: a required or named tool call constrains the reply itself; leave "
                             "sampling.structured unset")
        sampling = dataclasses.replace(sampling, structured=tools.constraint)
    slo = RequestedSlo(ttft_ms=msg.slo.ttft_ms or None, tpot_ms=msg.slo.tpot_ms or None)
    request = GenerateRequest(
        prompt=_prompt_from_proto(msg, described if tools.render_tools else []),
        sampling=sampling,
        model=msg.model,
        request_id=msg.request_id,
        slo=slo,
        priority=msg.priority,
        user=msg.user,
        caller=caller,
    )
    return request, tools


def _tools_from_proto(msg: gateway_pb2.GenerateRequest) -> list[Tool]:
    if msg.tools and msg.WhichOneof("prompt") != "chat":
        raise ValueError("tools: only a chat prompt describes tools")
    tools = []
    for index, tool in enumerate(msg.tools):
        try:
            parameters = json.loads(tool.parameters_json) if tool.parameters_json else None
        except ValueError as error:
            raise ValueError(f"tools.{index}.parameters_json: not JSON: {error}") from None
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools.{index}.parameters_json: a JSON schema is an object")
        tools.append(Tool.declared(tool.name, tool.description, parameters))
    return checked_tools(tools)


def _tool_use_from_proto(msg: gateway_pb2.GenerateRequest, tools: list[Tool], flags: ToolFlags) -> ToolUse:
    kind = msg.tool_choice.WhichOneof("choice")
    choice = getattr(msg.tool_choice, kind) if kind else None
    if kind == "mode" and choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice.mode: {choice!r} is none of none, auto, required")
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True
    return tool_use(tools, choice, parallel, flags)


def _prompt_from_proto(msg: gateway_pb2.GenerateRequest, tools: list[Tool]) -> Prompt:
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        return TextPrompt(msg.text)
    if kind == "token_ids":
        return TokenPrompt(tuple(msg.token_ids.ids))
    if kind == "chat":
        return ChatPrompt(tuple(ChatMessage(m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments)
                                                                     for c in m.tool_calls), m.tool_call_id)
                                for m in msg.chat.messages), tuple(tools))
    raise ValueError("prompt: must be set (text, token_ids or chat)")
