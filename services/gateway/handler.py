"""The Gateway gRPC service: validate, tokenize, pick workers, relay the decode worker's stream."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from tandem.v1 import decode_pb2, gateway_pb2, gateway_pb2_grpc

from services.common.convert import sampling_params_from_proto
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.router import NoWorkerError
from services.gateway.telemetry import RequestObservation
from services.gateway.workers import WorkerRegistry, dispatched
from services.observability.tracing import capture_content

log = logging.getLogger(__name__)

# Refusals that leave the request untouched, so the next decode worker may take it.
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """tandem.v1.Gateway over a worker registry; `model` is set once loaded (UNAVAILABLE before)."""

    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.metrics = metrics
        self.model: ServedModel | None = None
        self.capture_content = capture_content()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        model = await self._loaded(context)
        return gateway_pb2.ListModelsResponse(
            models=[gateway_pb2.Model(id=model.id, max_model_len=model.max_model_len)]
        )

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        model = await self._loaded(context)
        request_id = request.request_id or uuid.uuid4().hex
        observation = RequestObservation(self.metrics, request_id, request, self.capture_content)
        try:
            async for response in self._generate(request, request_id, model, context, observation):
                observation.streamed(response.chunk)
                yield response
        except BaseException as error:
            # context.abort raised (its code is on the context), the client went away, or a bug.
            code = context.code()
            name = code.name if code is not None else "INTERNAL" if isinstance(error, Exception) else "CANCELLED"
            observation.failed(name, context.details() or type(error).__name__)
            raise
        finally:
            observation.close()

    async def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        request_id: str,
        model: ServedModel,
        context: grpc.aio.ServicerContext,
        observation: RequestObservation,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        if request.model and request.model != model.id:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} is not served here; the model is {model.id!r}")
        try:
            prompt = model.prompt_token_ids(request)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{error}")
        observation.accepted(len(prompt), params)
        try:
            with observation.routing() as route:
                decoders = self.registry.decode_order()
                prefillers = self.registry.prefill_order()
                route["tandem.route.decode_order"] = [worker.address for worker in decoders]
                route["tandem.route.prefill_order"] = [worker.address for worker in prefillers]
        except NoWorkerError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))

        refusals: list[tuple[grpc.StatusCode, str]] = []
        for attempt, decode in enumerate(decoders):
            prefill = prefillers[attempt % len(prefillers)]
            # Unique at the workers whatever clients send; a refused attempt may still be winding down there.
            worker_request = decode_pb2.DecodeRequest(
                request_id=f"{request_id}-{uuid.uuid4().hex[:12]}",
                prompt_token_ids=prompt,
                sampling=request.sampling,
                prefill_address=prefill.address,
            )
            log.debug("request %s (%s): %d prompt tokens -> decode %s, prefill %s",
                      request_id, worker_request.request_id, len(prompt), decode.address, prefill.address)
            observation.dispatched(attempt, decode.address, prefill.address)
            call = decode.stub.Generate(worker_request, timeout=context.time_remaining())
            streamed = False
            with dispatched(decode, prefill, len(prompt)) as dispatch:
                try:
                    async for chunk in call:
                        if not streamed:
                            streamed = True
                            dispatch.prefilled()
                        yield gateway_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
                    return
                except grpc.aio.AioRpcError as error:
                    if streamed or error.code() not in _RETRYABLE:
                        await context.abort(error.code(), error.details() or "")
                    log.info("request %s: decode worker %s refused it (%s: %s)",
                             request_id, decode.address, error.code().name, error.details())
                    observation.refused(decode.address, error.code().name, error.details() or "")
                    refusals.append((error.code(), f"{decode.address}: {error.details()}"))
                finally:
                    # Cancels the worker's request when our client went away; a no-op once it ended.
                    call.cancel()
        exhausted = all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in refusals)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.UNAVAILABLE,
            "every decode worker refused the request: " + "; ".join(detail for _, detail in refusals),
        )

    async def _loaded(self, context: grpc.aio.ServicerContext) -> ServedModel:
        model = self.model
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is still loading its model")
        return model

