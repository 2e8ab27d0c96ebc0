"""The gateway's core, the same for every client API (gRPC, OpenAI-compatible HTTP).

`GatewayService.generate` validates and tokenizes a request, has admission place it (the SLO
router's choice, at once or after a bounded wait), and streams the chosen decode worker's chunks,
moving on to the next best placement while workers refuse or fail the request before its first
token: without the decode worker that refused it, or without the prefill worker that the decode
worker blames (then the same decode worker may serve it, prefilling itself when no prefill worker
is left). A request whose decode worker fails mid-stream resumes on another one
(services.gateway.migration).
Failures are `StatusError`s carrying a gRPC status code; each API maps them to its own errors.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from services.common.chunk import Chunk
from services.common.errors import StatusError
from services.gateway.admission import Admission, Rejected
from services.gateway.choices import ChoiceGroup
from services.gateway.formats import served_formats
from services.gateway.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import MigrationPolicy, StreamProgress
from services.gateway.model import ServedModel
from services.gateway.registry import Placement, WorkerRegistry
from services.gateway.request import GenerateRequest
from services.gateway.router import NoWorkerError, SloTargets
from services.gateway.telemetry import RequestObservation, record_refusal
from services.observability.tracing import capture_content

log = logging.getLogger(__name__)

# Refusals that leave the request untouched, so the next decode worker may take it.
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class GatewayService:
    """Requests in, chunks out, over a worker registry; `model` is set once loaded."""

    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics, max_queued: int = 256,
                 limits: RequestLimits = DEFAULT_REQUEST_LIMITS, migration: MigrationPolicy | None = None) -> None:
        """`max_queued`: requests that may wait for capacity at once (beyond it they are refused);
        `limits`: the longest prompt and prompt plus output a request may have; `migration`: how
        often a request may move on when its decode worker fails mid-stream (None: the default policy)."""
        self.registry = registry
        self.metrics = metrics
        self.limits = limits
        self.migration = migration or MigrationPolicy()
        self.admission: Admission[Placement] = Admission(registry, max_queued)
        registry.on_change(self.admission.changed)
        self.model: ServedModel | None = None
        self._capture_content = capture_content()

    def served_model(self) -> ServedModel:
        """The model; StatusError UNAVAILABLE while it is still loading."""
        if self.model is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the gateway is still loading its model")
        return self.model

    def served_formats(self) -> dict[str, str | None]:
        """The formats the workers serve the model in (services.gateway.formats)."""
        return served_formats(worker.report for worker in self.registry.workers if worker.report is not None)

    def ready(self) -> bool:
        """Whether requests can be served now: the model is loaded and the workers can take requests."""
        return self.model is not None and self.registry.routable()

    def refused(self, request_id: str, code: str, message: str) -> None:
        """An API edge refused a request before it reached `generate` (its body did not convert):
        traced and counted like the requests that did."""
        record_refusal(self.metrics, request_id, code, message)

    def slo(self, request: GenerateRequest) -> SloTargets:
        """The request's objectives: its own, else the deployment's."""
        default = self.registry.default_slo
        return SloTargets(request.slo.ttft_ms / 1000 if request.slo.ttft_ms else default.ttft_s,
                   request.slo.tpot_ms / 1000 if request.slo.tpot_ms else default.tpot_s)

    async def place(self, request: GenerateRequest, prompt: list[int], slo: SloTargets, arrived_at: float,
                    exclude: frozenset[str] = frozenset()) -> Placement:
        """Where the request runs, once admission lets it in (see services.gateway.admission).
        StatusError RESOURCE_EXHAUSTED (with a retry-after hint) when refused, UNAVAILABLE when no
        worker could take it at all."""
        route_request = self.registry.route_request(prompt, request.sampling.max_tokens, slo)
        try:
            if exclude:  # a retry after a refusal: no queueing, the best other worker now
                return self.registry.claim(route_request, self.registry.decide(route_request, exclude=exclude))
            return await self.admission.admit(route_request, request.priority, arrived_at)
        except NoWorkerError as error:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, str(error)) from error
        except Rejected as rejected:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(rejected),
                              retry_after_s=rejected.retry_after_s) from rejected

    async def generate(self, request: GenerateRequest, deadline: float | None = None,
                       group: ChoiceGroup | None = None) -> AsyncIterator[Chunk]:
        """Stream the request's chunks; the last one carries finish reason, usage and timings.

        `deadline` is a `time.monotonic()` instant the workers must finish by (None: no limit);
        `group`: the choices of one prompt the request is one of (None: the prompt's only one).
        Raises StatusError: UNAVAILABLE (loading, no serving worker, every worker unavailable),
        NOT_FOUND (another model), INVALID_ARGUMENT (the prompt, or a limit), RESOURCE_EXHAUSTED (refused by
        admission, or every decode worker full), or a worker's own code when it fails after the
        first token and the request cannot move on (services.gateway.migration). Every validation
        error comes before the first chunk. The request is traced and counted
        (services.gateway.telemetry) however it ends.
        """
        request_id = request.request_id or uuid.uuid4().hex
        observation = RequestObservation(self.metrics, request_id, request, self._capture_content, group)
        try:
            # aclosing: a consumer that stops early (client gone) must close the inner stream at once,
            # which cancels the request on its workers; left to the garbage collector it would not.
            async with contextlib.aclosing(self._generate(request, request_id, deadline, observation)) as chunks:
                async for chunk in chunks:
                    observation.streamed(chunk)
                    yield chunk
        except StatusError as error:
            observation.failed(error.code.name, error.message)
            raise
        except Exception as error:
            observation.failed("INTERNAL", f"{type(error).__name__}: {error}")
            raise
        except BaseException:
            observation.failed("CANCELLED", "the client went away")
            raise
        finally:
            observation.close()

    async def _generate(self, request: GenerateRequest, request_id: str, deadline: float | None,
                        observation: RequestObservation) -> AsyncIterator[Chunk]:
        arrived_at = time.monotonic()
        model = self.served_model()
        if request.model and request.model != model.id:
            raise StatusError(grpc.StatusCode.NOT_FOUND,
                              f"model {request.model!r} is not served here; the model is {model.id!r}")
        try:
            prompt = list(model.checked_prompt(request.prompt).ids)
            self.limits.check(len(prompt), request.sampling.max_tokens, model.max_model_len)
        except ValueError as error:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
        observation.accepted(len(prompt), request.sampling)
        slo = self.slo(request)

        progress = StreamProgress(self.migration)
        refusals: list[tuple[grpc.StatusCode, str]] = []
        refused: frozenset[str] = frozenset()
        while True:
            try:
                with observation.routing() as route:
                    placement = await self.place(request, progress.context(prompt), slo, arrived_at, refused)
                    observation.placed(route, placement.decision, slo)
            except StatusError:
                if not refusals:
                    raise
                break  # no other worker left to try
            decision = placement.decision
            observation.dispatched(len(refusals), decision.decode, decision.prefill or "local")
            # Unique at the workers whatever clients send; a refused attempt may still be winding down there.
            worker_request_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
            log.debug("request %s (%s): %d prompt tokens: %s", request_id, worker_request_id, len(prompt),
                      "; ".join(decision.reasons[:1]))
            timeout = None if deadline is None else deadline - time.monotonic()
            stream = placement.decode.generate(request_id, worker_request_id, prompt, request.sampling,
                                               decision.prefill or "", timeout, progress.resumed())
            streamed = False
            try:
                async for chunk in stream:
                    if not streamed:
                        streamed = True
                        placement.prefilled()
                    placement.delivered(len(chunk.token_ids))
                    yield progress.delivered(chunk)
                return
            except StatusError as error:
                if streamed and progress.migrate(error):
                    observation.migrated(placement.decode.address, error.code.name, error.message,
                                         len(progress.token_ids), progress.migrations)
                    refused |= {placement.decode.address}
                    continue
                if streamed or not _retryable(error):
                    raise
                failed = error.failed_prefill or placement.decode.address
                log.info("request %s: worker %s refused or failed it (%s: %s)",
                         request_id, failed, error.code.name, error.message)
                observation.refused(failed, error.code.name, error.message)
                refusals.append((error.code, f"{failed}: {error.message}"))
                refused |= {failed}
            finally:
                await stream.aclose()
                placement.release()
        exhausted = all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in refusals)
        raise StatusError(
            grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.UNAVAILABLE,
            "every worker tried refused or failed the request: " + "; ".join(detail for _, detail in refusals),
        )


def _retryable(error: StatusError) -> bool:
    """Whether a failure before the first token may be retried elsewhere: a refusal that left the
    request untouched, or a failure the decode worker blames on its prefill worker (a transfer
    deadline included: that worker's fault, not the client's deadline)."""
    return error.code in _RETRYABLE or error.failed_prefill is not None
