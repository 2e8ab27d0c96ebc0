"""The gateway's core, the same for every client API (gRPC, OpenAI-compatible HTTP).

`GatewayService.generate` validates and tokenizes a request, charges it to its caller's rate limits
(services.gateway.rate_limits), has admission place it (the SLO router's choice, at once or after a
bounded wait), and streams the chosen decode worker's chunks, moving on to the next best placement
while workers refuse or fail the request before its first token: without the decode worker that
refused it, or without the prefill worker that the decode worker blames (then the same decode worker
may serve it, prefilling itself when no prefill worker is left). A request whose decode worker fails
mid-stream resumes on another one (services.gateway.migration).
Failures are `StatusError`s carrying a gRPC status code; each API maps them to its own errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from engine.kv_cache.block_hash import PROBE_TEXT
from services.common.chunk import Chunk
from services.common.errors import StatusError
from services.gateway.adapter_watch import AdapterWatch
from services.gateway.admission import Admission, Rejected
from services.gateway.caller import Caller
from services.gateway.catalog import ModelCatalog, Target, UnknownModel
from services.gateway.choices import ChoiceGroup
from services.gateway.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from services.gateway.listing import ModelListing, model_listings
from services.gateway.metrics import RATE_LIMIT, WORKERS_FULL, GatewayMetrics
from services.gateway.migration import MigrationPolicy, StreamProgress
from services.gateway.rate_limits import Charge, RateLimited, RateLimiter
from services.gateway.registry import Placement, WorkerRegistry
from services.gateway.request import GenerateRequest
from services.gateway.router import NoWorkerError, SloTargets
from services.gateway.telemetry import RequestObservation, record_refusal
from services.observability.tracing import capture_content

log = logging.getLogger(__name__)

# Refusals that leave the request untouched, so the next decode worker may take it.
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class GatewayService:
    """Requests in, chunks out, over a worker registry; `catalog` is set once loaded."""

    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics, max_queued: int = 256,
                 limits: RequestLimits = DEFAULT_REQUEST_LIMITS, migration: MigrationPolicy | None = None,
                 rate_limits: RateLimiter | None = None) -> None:
        """`max_queued`: requests that may wait for capacity at once (beyond it they are refused);
        `limits`: the longest prompt and prompt plus output a request may have; `migration`: how
        often a request may move on when its decode worker fails mid-stream (None: the default policy);
        `rate_limits`: the buckets of the callers' keys (None: fresh ones on the monotonic clock)."""
        self.registry = registry
        self.metrics = metrics
        self.limits = limits
        self.rate_limits = rate_limits or RateLimiter()
        self.migration = migration or MigrationPolicy()
        self.admission: Admission[Placement] = Admission(registry, max_queued)
        registry.on_change(self.admission.changed)
        registry.probe.probe_tokens = self.probe_tokens
        self.catalog: ModelCatalog | None = None
        self.adapters = AdapterWatch(registry, lambda: self.catalog.names if self.catalog is not None else ())
        metrics.registry.register(self.adapters)
        self._capture_content = capture_content()

    def served_catalog(self) -> ModelCatalog:
        """The models served; StatusError UNAVAILABLE while they are still loading."""
        if self.catalog is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the gateway is still loading its models")
        return self.catalog

    def resolve(self, requested: str, caller: str | None = None, key: Caller | None = None) -> Target:
        """The version a request's `model` names for this caller (services.gateway.catalog), or the
        LoRA adapter it names on its base version. StatusError PERMISSION_DENIED naming a model the
        API `key` may not use, NOT_FOUND naming what is not served, UNAVAILABLE while loading or for
        an adapter whose workers disagree (services.gateway.adapters)."""
        catalog = self.served_catalog()
        name = (requested or catalog.default_name).partition("@")[0]
        if key is not None and not key.may_use(name):
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"model: the API key {key.name} may not use the model `{name}`")
        try:
            return catalog.resolve(requested, caller)
        except UnknownModel as error:
            return self.adapters.target(requested, catalog, error)

    def models(self) -> list[ModelListing]:
        """Every model version served, and every LoRA adapter routed to, as the model lists show them."""
        return model_listings(self.served_catalog(), self.registry.workers, self.adapters.table)

    def worker_health(self) -> list[dict[str, object]]:
        """Each worker as the health detail shows it: address, role, routable, its prefix information
        ("approximate" with that index; else "exact", or why the exact index refuses it:
        services.gateway.hash_probe), the blocks its tiers hold by the index, and how many of its
        events the gateway has received."""
        def prefix_index(address: str) -> str:
            if self.registry.prefix_index == "approximate":
                return "approximate"
            return self.registry.probe.refusal(address) or "exact"

        return [{"address": worker.address, "role": worker.role, "routable": worker.routable,
                 "prefix_index": prefix_index(worker.address),
                 "kv_blocks": self.registry.blocks.counts(worker.address),
                 "kv_events_seq": worker.report.kv_events_seq if worker.report is not None else None}
                for worker in self.registry.workers]

    def probe_tokens(self, version_key: str | None) -> list[int] | None:
        """The hash probe's text (engine.kv_cache.block_hash.PROBE_TEXT) as the tokenizer of the model
        a worker reports serving tokenizes it; None while the models load or for one not served."""
        model = self.catalog.model_for(version_key) if self.catalog is not None else None
        return model.tokenizer.encode(PROBE_TEXT) if model is not None else None

    def target_for(self, request: GenerateRequest) -> Target:
        """The version the request's `model` names for its caller: its `user`, else its API key's
        name (services.gateway.catalog); StatusError as `resolve`."""
        return self.resolve(request.model, request.user or (request.caller.name if request.caller else None),
                            request.caller)

    def ready(self) -> bool:
        """Whether requests can be served now: the model is loaded and the workers can take requests."""
        return self.catalog is not None and self.registry.routable()

    def refused(self, request_id: str, code: str, message: str, capacity_reason: str | None = None) -> None:
        """An API edge refused a request before it reached `generate` (its body did not convert, or
        `capacity_reason`: too many in flight): traced and counted like the requests that did."""
        record_refusal(self.metrics, request_id, code, message, capacity_reason)

    def slo(self, request: GenerateRequest) -> SloTargets:
        """The request's objectives: its own, else the deployment's."""
        default = self.registry.default_slo
        return SloTargets(request.slo.ttft_ms / 1000 if request.slo.ttft_ms else default.ttft_s,
                   request.slo.tpot_ms / 1000 if request.slo.tpot_ms else default.tpot_s)

    async def place(self, request: GenerateRequest, prompt: list[int], slo: SloTargets, arrived_at: float,
                    observation: RequestObservation, exclude: frozenset[str] = frozenset(),
                    target: Target | None = None) -> Placement:
        """Where the request runs, once admission lets it in (see services.gateway.admission), on
        workers serving `target` (its version and adapter; None: any worker, the base model).
        StatusError RESOURCE_EXHAUSTED (with a retry-after hint) when refused (told to
        `observation`), UNAVAILABLE when no worker could take it at all."""
        route_request = self.registry.route_request(
            prompt, request.sampling.max_tokens, slo, target.version_key if target is not None else None,
            request.sampling.cache_salt, target.adapter if target is not None else None)
        try:
            if exclude:  # a retry after a refusal: no queueing, the best other worker now
                return self.registry.claim(route_request, self.registry.decide(route_request, exclude=exclude))
            return await self.admission.admit(route_request, request.priority, arrived_at)
        except NoWorkerError as error:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, str(error)) from error
        except Rejected as rejected:
            observation.turned_away(rejected.reason)
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(rejected),
                              retry_after_s=rejected.retry_after_s) from rejected

    async def generate(self, request: GenerateRequest, deadline: float | None = None,
                       target: Target | None = None, group: ChoiceGroup | None = None) -> AsyncIterator[Chunk]:
        """Stream the request's chunks; the last one carries finish reason, usage and timings.

        `deadline` is a `time.monotonic()` instant the workers must finish by (None: no limit).
        `target` is the model version it runs on, when the API edge resolved it already (None:
        resolved here from the request's `model`, for its `user` or else its API key's name);
        `group`: the choices of one prompt the request is one of (None: the prompt's only one).
        Raises StatusError: UNAVAILABLE (loading, no serving worker, every worker unavailable),
        NOT_FOUND (a model or version not served), INVALID_ARGUMENT (the prompt, or a limit),
        RESOURCE_EXHAUSTED (refused by the caller's rate limits or by admission, with a retry-after
        hint, or every decode worker full), or a worker's own code when it fails after the first
        token and the request cannot move on (services.gateway.migration). Every validation error
        comes before the first chunk.
        The request is traced and counted (services.gateway.telemetry), and settled with the
        caller's rate limits with the tokens it used, however it ends.
        """
        arrived_at = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        observation = RequestObservation(self.metrics, request_id, request, self._capture_content, group)
        charge: Charge | None = None
        try:
            target = target or self.target_for(request)
            observation.resolved(target)
            prompt = self._accepted(request, target, observation)
            charge = self._charged(request, len(prompt), observation)
            # aclosing: a consumer that stops early (client gone) must close the inner stream at once,
            # which cancels the request on its workers; left to the garbage collector it would not.
            if target.adapter is not None:
                request = dataclasses.replace(request, sampling=dataclasses.replace(
                    request.sampling, lora_name=target.adapter.name))
            async with contextlib.aclosing(
                    self._generate(request, request_id, prompt, arrived_at, deadline, observation,
                                   target)) as chunks:
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
            if charge is not None:
                charge.settle(observation.used_tokens)

    def _accepted(self, request: GenerateRequest, target: Target, observation: RequestObservation) -> list[int]:
        """The request's prompt as token ids for its model version, once the request is known to be
        servable."""
        model = target.model
        try:
            prompt = list(model.checked_prompt(request.prompt).ids)
            self.limits.check(len(prompt), request.sampling.max_tokens, model.max_model_len)
        except ValueError as error:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
        observation.accepted(len(prompt), request.sampling)
        return prompt

    def _charged(self, request: GenerateRequest, prompt_tokens: int, observation: RequestObservation) -> Charge:
        """The request's charge to its caller's rate limits: its prompt and max_tokens, settled when
        it ends. StatusError RESOURCE_EXHAUSTED, with when to retry, when the limits refuse it."""
        try:
            return self.rate_limits.admit(request.caller, prompt_tokens + request.sampling.max_tokens)
        except RateLimited as limited:
            self.metrics.key_rate_limited(request.caller.name if request.caller is not None else "")
            observation.turned_away(RATE_LIMIT)
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(limited),
                              retry_after_s=limited.retry_after_s) from limited

    async def _generate(self, request: GenerateRequest, request_id: str, prompt: list[int], arrived_at: float,
                        deadline: float | None, observation: RequestObservation,
                        target: Target) -> AsyncIterator[Chunk]:
        slo = self.slo(request)
        version_key = target.version_key

        progress = StreamProgress(self.migration)
        refusals: list[tuple[grpc.StatusCode, str]] = []
        refused: frozenset[str] = frozenset()
        while True:
            try:
                with observation.routing() as route:
                    placement = await self.place(request, progress.context(prompt), slo, arrived_at, observation,
                                                 refused, target)
                    observation.placed(route, placement.decision, slo)
                    self.metrics.prefix_hit(placement.prefix_hit_tokens)
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
                                               decision.prefill or "", timeout, progress.resumed(), version_key, slo)
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
        if exhausted:
            observation.turned_away(WORKERS_FULL)
        raise StatusError(
            grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.UNAVAILABLE,
            "every worker tried refused or failed the request: " + "; ".join(detail for _, detail in refusals),
        )


def _retryable(error: StatusError) -> bool:
    """Whether a failure before the first token may be retried elsewhere: a refusal that left the
    request untouched, or a failure the decode worker blames on its prefill worker (a transfer
    deadline included: that worker's fault, not the client's deadline)."""
    return error.code in _RETRYABLE or error.failed_prefill is not None
