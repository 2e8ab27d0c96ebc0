"""One gateway request as the trace, the metrics and the log see it.

The request's span is the SERVER span of the call that carries it (gRPC Generate, or the HTTP
request through the OpenTelemetry ASGI middleware); this annotates it with the
GenAI semantic-convention attributes and `tandem.*` timings, adds the routing span, and keeps the
gateway's metrics. Prompts and completions go on the span only when
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from engine.sampling_params import SamplingParams
from services.common.chunk import Chunk
from services.gateway.catalog import Target
from services.gateway.choices import ChoiceGroup
from services.gateway.metrics import GatewayMetrics
from services.gateway.request import ChatPrompt, GenerateRequest, TextPrompt
from services.gateway.router import Decision, SloTargets
from services.observability.spans import TRACER, set_error

log = logging.getLogger(__name__)

# The Timings fields the gateway measures itself, for the whole stream.
_GATEWAY_TIMINGS = frozenset({"ttft_s", "tpot_s", "e2e_s"})


class RequestObservation:
    """Create it when a request arrives (inside its RPC); call the stage methods as it goes, and
    `close` once it ended however it ended."""

    def __init__(self, metrics: GatewayMetrics, request_id: str, request: GenerateRequest,
                 capture_content: bool, group: ChoiceGroup | None = None) -> None:
        """`group`: the choices of the prompt this request is one of (None: it is the only one)."""
        # The gateway's metrics until the request's model version is known, then bound to its labels.
        self._metrics = metrics
        self._group = group
        self._request_id = request_id
        self._request = request
        self._capture = capture_content
        self._span = trace.get_current_span()
        self._traced = self._span.is_recording()
        self._arrived_at = time.perf_counter()
        self._first_at: float | None = None
        self._last_at = 0.0
        self._output: list[str] = []
        self._running = False
        self._waiting = False
        self._resolved = False
        self._slo: SloTargets | None = None
        self._workers = ("", "")  # (decode, prefill) of the latest attempt, for the finish log line
        # The router's predictions for the latest placement, logged beside what happened, so a
        # deployment's logs show how well its step models predict (a bias misroutes and refuses).
        self._predicted: tuple[float, float] | None = None
        self._placed_after = 0.0  # arrival to the latest placement: tokenizing and admission's wait
        self._model_version = ""  # NAME@VERSION that serves it, once resolved
        self._key = request.caller.name if request.caller is not None else ""
        self._prompt_tokens = 0
        self._used = (0, 0)  # (prompt, completion) tokens the client has had so far
        if self._traced:
            self._span.set_attributes({
                "gen_ai.operation.name": "chat" if isinstance(request.prompt, ChatPrompt) else "text_completion",
                "gen_ai.request.model": request.model or metrics.model_name,
                "tandem.request_id": request_id,
            })

    def resolved(self, target: Target) -> None:
        """The request runs on this model version (the A/B split's choice): on the span, in the finish
        log, and the labels of its metrics from now on; it now waits for a worker."""
        self._model_version = target.fingerprint
        self._metrics = self._metrics.labelled(target.served_name, target.version)
        self._group = self._group or ChoiceGroup(self._metrics)
        self._resolved = self._waiting = True
        self._metrics.waiting.inc()
        self._metrics.key_request(self._key)
        if self._traced:
            self._span.set_attribute("tandem.model_version", target.fingerprint)

    def accepted(self, prompt_tokens: int, params: SamplingParams) -> None:
        """The prompt is tokenized and the sampling parameters valid."""
        self._prompt_tokens = prompt_tokens
        if not self._traced:
            return
        self._span.set_attributes({
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": prompt_tokens,
        })
        if self._capture:
            self._span.set_attribute("gen_ai.input.messages", json.dumps(_input_messages(self._request)))

    @contextlib.contextmanager
    def routing(self) -> Iterator[dict[str, AttributeValue]]:
        """The routing decision's span; the router puts why it chose what it chose into the yielded
        dict (`tandem.route.*` attributes), which becomes the span's attributes."""
        attributes: dict[str, AttributeValue] = {}
        if not self._traced:
            yield attributes
            return
        with TRACER.start_as_current_span("route") as span:
            yield attributes
            span.set_attributes(attributes)

    def placed(self, attributes: dict[str, AttributeValue], decision: Decision, slo: SloTargets) -> None:
        """Put the router's decision on the routing span's attributes: the choice and its kind
        (aggregated or disaggregated, also counted), its predictions (TTFT at the prefill site, TPOT
        at the decode site) against the objectives, and the options weighed."""
        self._slo = slo
        self._predicted = (decision.ttft_s, decision.tpot_s)
        self._placed_after = time.perf_counter() - self._arrived_at
        self._metrics.placed(decision.kind)
        attributes.update({
            "tandem.route.placement": decision.kind,
            "tandem.route.decode": decision.decode,
            "tandem.route.prefill": decision.prefill or "local",
            "tandem.route.predicted_ttft_s": decision.ttft_s,
            "tandem.route.predicted_tpot_s": decision.tpot_s,
            "tandem.route.slo_ttft_s": slo.ttft_s,
            "tandem.route.slo_tpot_s": slo.tpot_s,
            "tandem.route.meets_slo": decision.meets_slo,
            "tandem.route.options": list(decision.reasons),
        })

    def dispatched(self, attempt: int, decode: str, prefill: str) -> None:
        """Attempt `attempt` (0 first) goes to these decode and prefill workers ("local": none)."""
        if self._waiting:  # the first attempt: admission let it in
            self._waiting = False
            self._metrics.waiting.dec()
            self._running = True
            self._metrics.running.inc()
            self._metrics.admitted()
        self._metrics.routed("decode", decode)
        self._metrics.routed("prefill", prefill)
        self._workers = (decode, prefill)
        if self._traced:
            chosen = {"tandem.decode.address": decode, "tandem.prefill.address": prefill,
                      "tandem.route.attempt": attempt}
            self._span.add_event("dispatch", chosen)
            self._span.set_attributes(chosen)

    def refused(self, worker: str, code: str, details: str) -> None:
        """The attempt was refused or failed before streaming, by `worker` (the decode worker, or
        the prefill worker it blamed); the next placement without it is tried."""
        if self._traced:
            self._span.add_event("refused", {"tandem.worker.address": worker, "error.type": code,
                                             "tandem.detail": details})

    def turned_away(self, reason: str) -> None:
        """The request is refused for capacity (RESOURCE_EXHAUSTED), for this reason
        (services.gateway.metrics.REFUSAL_REASONS); `failed` follows."""
        self._metrics.refused(reason)

    def migrated(self, decode: str, code: str, details: str, delivered_tokens: int, migrations: int) -> None:
        """The decode worker failed after streaming; the request resumes elsewhere after
        `delivered_tokens` output tokens (its `migrations`-th move)."""
        self._metrics.migrated()
        log.warning("request %s: decode worker %s failed after %d output tokens (%s: %s); resuming it on "
                    "another worker (migration %d)", self._request_id, decode, delivered_tokens, code, details,
                    migrations)
        if self._traced:
            self._span.add_event("migrated", {"tandem.decode.address": decode, "error.type": code,
                                              "tandem.detail": details, "tandem.delivered_tokens": delivered_tokens})
            self._span.set_attribute("tandem.migrations", migrations)

    def streamed(self, chunk: Chunk) -> None:
        """A chunk went to the client."""
        now = time.perf_counter()
        metrics = self._metrics
        # The first chunk means the prompt was computed; the last one's usage has the whole count.
        usage = chunk.usage
        self._used = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (
            self._prompt_tokens, self._used[1] + len(chunk.token_ids))
        if chunk.token_ids:
            if self._first_at is None:
                self._first_at = now
                metrics.ttft.observe(now - self._arrived_at)
                if self._traced:
                    self._span.add_event("first_token")
            else:
                metrics.output_gap(now - self._last_at, len(chunk.token_ids))
            self._last_at = now
        if self._capture and self._traced:
            self._output.append(chunk.text)
        if chunk.finish_reason:
            self._finished(chunk, now)

    def failed(self, code: str, message: str) -> None:
        """The request ended with an error status (`code` is the gRPC code's name)."""
        self._metrics.rejected(code)
        set_error(code, message, self._span)
        log.info("request %s failed: %s: %s", self._request_id, code, message)

    @property
    def used_tokens(self) -> int:
        """The tokens the request used, as its key's usage and rate limits count them: its prompt's
        once a chunk came back (a request refused before that used none), and those generated."""
        return sum(self._used)

    def close(self) -> None:
        """Leave the in-flight gauges and account the key's usage (whatever happened)."""
        if self._resolved:
            self._metrics.key_usage(self._key, *self._used)
        if self._waiting:
            self._metrics.waiting.dec()
        if self._running:
            self._metrics.running.dec()
        self._waiting = self._running = False

    def _finished(self, chunk: Chunk, now: float) -> None:
        metrics, usage, reason = self._metrics, chunk.usage, chunk.finish_reason or ""
        if usage is None or chunk.timings is None:
            return
        e2e = now - self._arrived_at
        ttft = (self._first_at or now) - self._arrived_at
        tpot = (now - self._first_at) / (usage.completion_tokens - 1) if (
            self._first_at is not None and usage.completion_tokens > 1) else 0.0
        metrics.e2e.observe(e2e)
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.generation_tokens.inc(usage.completion_tokens)
        metrics.prefix_cache(usage.prompt_tokens, usage.cached_tokens)
        metrics.succeeded(reason)
        metrics.served()
        if self._slo is not None:
            metrics.objectives(ttft <= self._slo.ttft_s, tpot <= self._slo.tpot_s)
        timings = chunk.timings
        # vLLM's phases: prefill is the prompt's compute and, disaggregated, the wait for its KV (the
        # queues before are not in it); decode runs from the first token to the last, as the client saw them.
        metrics.request_finished(usage.prompt_tokens, usage.completion_tokens, self._request.sampling.max_tokens,
                                 timings.prefill_compute_s + timings.kv_wait_s,
                                 now - self._first_at if self._first_at is not None else 0.0, tpot)
        if self._group is not None:
            self._group.finished(usage.completion_tokens)
        # Every worker timing under its own name (so a new one is logged with no change here), except
        # ttft, tpot and e2e, which are the gateway's own; the worker's TTFT is worker_ttft_s.
        # TTFT's parts: placed_s at the gateway, then worker_ttft_s at the decode worker, which is
        # reserve_s + prefill_queue_s + prefill_compute_s + kv_wait_s + batch_join_s when disaggregated.
        worker = {name: round(value, 6) for name, value in dataclasses.asdict(timings).items()
                  if name not in _GATEWAY_TIMINGS}
        record: dict[str, Any] = {
            "request_id": self._request_id, "trace_id": self._trace_id(), "model_version": self._model_version,
            "finish_reason": reason,
            "prompt_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens, "ttft_s": round(ttft, 6), "tpot_s": round(tpot, 6),
            "e2e_s": round(e2e, 6), **worker, "decode_s": round(max(0.0, timings.e2e_s - timings.ttft_s), 6),
            "placed_s": round(self._placed_after, 6), "worker_ttft_s": round(timings.ttft_s, 6),
            "decode_worker": self._workers[0], "prefill_worker": self._workers[1],
        }
        if self._predicted is not None:
            record["predicted_ttft_s"] = round(self._predicted[0], 6)
            record["predicted_tpot_s"] = round(self._predicted[1], 6)
        log.info("request finished %s", json.dumps(record))
        if not self._traced:
            return
        self._span.add_event("finish")
        self._span.set_attributes({
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.response.finish_reasons": [reason],
            "tandem.usage.cached_tokens": usage.cached_tokens,
            "tandem.ttft_s": ttft,
            "tandem.tpot_s": tpot,
            "tandem.e2e_s": e2e,
            "tandem.prefill.queue_s": timings.prefill_queue_s,
            "tandem.prefill.compute_s": timings.prefill_compute_s,
            "tandem.kv_wait_s": timings.kv_wait_s,
        })
        if self._capture:
            message = {"role": "assistant", "parts": [{"type": "text", "content": "".join(self._output)}],
                       "finish_reason": reason}
            self._span.set_attribute("gen_ai.output.messages", json.dumps([message]))

    def _trace_id(self) -> str:
        context = self._span.get_span_context()
        return trace.format_trace_id(context.trace_id) if context.is_valid else ""


def record_refusal(metrics: GatewayMetrics, request_id: str, code: str, message: str,
                   capacity_reason: str | None = None) -> None:
    """A request refused before it became one (its message did not convert, or `capacity_reason`,
    one of services.gateway.metrics.REFUSAL_REASONS, said no): counted, and marked on the current span."""
    span = trace.get_current_span()
    if span.is_recording() and request_id:
        span.set_attribute("tandem.request_id", request_id)
    metrics.rejected(code)
    if capacity_reason is not None:
        metrics.refused(capacity_reason)
    set_error(code, message, span)
    log.info("request %s refused: %s: %s", request_id or "(no id)", code, message)


def _input_messages(request: GenerateRequest) -> list[dict[str, Any]]:
    """The prompt in the GenAI conventions' message shape (token id prompts as their ids)."""
    prompt = request.prompt
    if isinstance(prompt, ChatPrompt):
        return [{"role": m.role, "parts": [{"type": "text", "content": m.content}]} for m in prompt.messages]
    content = prompt.text if isinstance(prompt, TextPrompt) else " ".join(map(str, prompt.ids))
    return [{"role": "user", "parts": [{"type": "text", "content": content}]}]
