"""The gateway's core, the same for every client API (gRPC, OpenAI-compatible HTTP).

`GatewayService.generate` validates and tokenizes a request, asks `route` which workers to try,
and streams the chosen decode worker's chunks, moving on to the next pair while workers refuse
the request before its first token. Failures are `StatusError`s carrying a gRPC status code; each
API maps them to its own errors.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common.chunk import Chunk
from services.common.errors import StatusError
from services.gateway.model import ServedModel
from services.gateway.request import GenerateRequest
from services.gateway.router import NoWorkerError
from services.gateway.workers import Worker, WorkerRegistry, dispatched

log = logging.getLogger(__name__)

# Refusals that leave the request untouched, so the next decode worker may take it.
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


@dataclass(frozen=True)
class Route:
    """One placement to try: the decode worker to call and the prefill worker it should use."""

    decode: Worker
    prefill: Worker


class GatewayService:
    """Requests in, chunks out, over a worker registry; `model` is set once loaded."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.model: ServedModel | None = None

    def served_model(self) -> ServedModel:
        """The model; StatusError UNAVAILABLE while it is still loading."""
        if self.model is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the gateway is still loading its model")
        return self.model

    def ready(self) -> bool:
        """Whether requests can be served now: the model is loaded and each pool has a serving worker."""
        return self.model is not None and self.registry.routable()

    def route(self, request: GenerateRequest, prompt_token_ids: list[int]) -> list[Route]:
        """The placements to try for a request, best first (least-loaded decode workers, each with
        the next least-loaded prefill worker); StatusError UNAVAILABLE when a pool has none serving."""
        try:
            decoders = self.registry.decode_order()
            prefillers = self.registry.prefill_order()
        except NoWorkerError as error:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, str(error)) from error
        return [Route(decode, prefillers[attempt % len(prefillers)]) for attempt, decode in enumerate(decoders)]

    async def generate(self, request: GenerateRequest, deadline: float | None = None) -> AsyncIterator[Chunk]:
        """Stream the request's chunks; the last one carries finish reason, usage and timings.

        `deadline` is a `time.monotonic()` instant the workers must finish by (None: no limit).
        Raises StatusError: UNAVAILABLE (loading, no serving worker, every worker unavailable),
        NOT_FOUND (another model), INVALID_ARGUMENT (the prompt), RESOURCE_EXHAUSTED (every
        decode worker full), or a worker's own code when it fails after the first token. Every
        validation error comes before the first chunk.
        """
        model = self.served_model()
        request_id = request.request_id or uuid.uuid4().hex
        if request.model and request.model != model.id:
            raise StatusError(grpc.StatusCode.NOT_FOUND,
                              f"model {request.model!r} is not served here; the model is {model.id!r}")
        try:
            prompt = model.prompt_token_ids(request.prompt)
        except ValueError as error:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error

        refusals: list[tuple[grpc.StatusCode, str]] = []
        for route in self.route(request, prompt):
            # Unique at the workers whatever clients send; a refused attempt may still be winding down there.
            worker_request_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
            log.debug("request %s (%s): %d prompt tokens -> decode %s, prefill %s", request_id,
                      worker_request_id, len(prompt), route.decode.address, route.prefill.address)
            timeout = None if deadline is None else deadline - time.monotonic()
            stream = route.decode.generate(request_id, worker_request_id, prompt, request.sampling,
                                           route.prefill.address, timeout)
            streamed = False
            with dispatched(route.decode, route.prefill, len(prompt)) as dispatch:
                try:
                    async for chunk in stream:
                        if not streamed:
                            streamed = True
                            dispatch.prefilled()
                        yield chunk
                    return
                except StatusError as error:
                    if streamed or error.code not in _RETRYABLE:
                        raise
                    log.info("request %s: decode worker %s refused it (%s: %s)",
                             request_id, route.decode.address, error.code.name, error.message)
                    refusals.append((error.code, f"{route.decode.address}: {error.message}"))
                finally:
                    await stream.aclose()
        exhausted = all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in refusals)
        raise StatusError(
            grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.UNAVAILABLE,
            "every decode worker refused the request: " + "; ".join(detail for _, detail in refusals),
        )
