"""The Gateway gRPC service: tandem.v1.Gateway messages to and from the gateway's core."""

from __future__ import annotations

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
)
from services.gateway.service import GatewayService

# Names the model version that served a Generate call (NAME@VERSION, or the model's name).
MODEL_VERSION_TRAILER = "tandem-model-version"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """tandem.v1.Gateway over a GatewayService."""

    def __init__(self, service: GatewayService) -> None:
        self.service = service

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
                              kv_cache_dtype=listing.formats["kv_cache_dtype"] or "")
            for listing in listings
        ])

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            core_request = generate_request_from_proto(request, current_caller())
        except ValueError as error:
            self.service.refused(request.request_id, "INVALID_ARGUMENT", str(error))
            await abort_with(context, error)
        trailers: list[tuple[str, str]] = []
        try:
            target = self.service.target_for(core_request)
            trailers.append((MODEL_VERSION_TRAILER, target.fingerprint))
            async for chunk in self.service.generate(core_request, deadline, target):
                yield gateway_pb2.GenerateResponse(request_id=chunk.request_id, chunk=chunk_to_proto(chunk))
        except (StatusError, ValueError) as error:
            await abort_with(context, error, [*trailers, *self._rate_limits(core_request)])
        context.set_trailing_metadata((*trailers, *self._rate_limits(core_request)))

    def _rate_limits(self, request: GenerateRequest) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* fields for the request's key as its limits stand now (none for a
        key without limits), sent as trailers as the HTTP API sends them as headers."""
        status = self.service.rate_limits.status(request.caller)
        return status.fields() if status is not None else []


def generate_request_from_proto(msg: gateway_pb2.GenerateRequest, caller: Caller | None = None) -> GenerateRequest:
    """The core's request for a GenerateRequest sent with `caller`'s key; ValueError naming the
    field when it is unusable."""
    try:
        sampling = sampling_params_from_proto(msg.sampling)
    except ValueError as error:
        raise ValueError(f"sampling.{error}") from error
    slo = RequestedSlo(ttft_ms=msg.slo.ttft_ms or None, tpot_ms=msg.slo.tpot_ms or None)
    return GenerateRequest(
        prompt=_prompt_from_proto(msg),
        sampling=sampling,
        model=msg.model,
        request_id=msg.request_id,
        slo=slo,
        priority=msg.priority,
        user=msg.user,
        caller=caller,
    )


def _prompt_from_proto(msg: gateway_pb2.GenerateRequest) -> Prompt:
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        return TextPrompt(msg.text)
    if kind == "token_ids":
        return TokenPrompt(tuple(msg.token_ids.ids))
    if kind == "chat":
        return ChatPrompt(tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages))
    raise ValueError("prompt: must be set (text, token_ids or chat)")
