"""OpenTelemetry tracing of one Tandem process, configured by the standard `OTEL_*` variables.

Tracing is on only when an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`). Otherwise nothing is set up: the OpenTelemetry API stays its no-op
self and gRPC is not instrumented, so tracing off costs nothing.

When on, `setup_tracing` (call it before any gRPC server or channel is created) installs an SDK
tracer provider with a batching OTLP exporter (gRPC or HTTP per `OTEL_EXPORTER_OTLP_PROTOCOL`;
sampling, batching and headers per their own `OTEL_*` variables) and instruments grpc.aio servers
and clients and sync gRPC clients, which carry W3C trace context in the RPCs' metadata; a caller's
own `traceparent` is therefore honoured. `service.name` is always `tandem-<role>`, even when a
shared environment sets `OTEL_SERVICE_NAME` for every process; other resource attributes come from
`OTEL_RESOURCE_ATTRIBUTES`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

log = logging.getLogger(__name__)

# Set by setup_tracing: whether this process traces (HTTP apps are wrapped only then).
_tracing_on = False

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_PROTOCOLS = ("grpc", "http/protobuf")
# The GenAI semantic conventions' opt-in for recording prompts and completions on spans.
_CAPTURE_CONTENT_VARIABLE = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# RPCs that would only add noise (or, for the exporter's own calls, feed back into themselves).
_UNTRACED_METHODS = ("WatchLoad", "GetLoad")
_UNTRACED_SERVICE_PREFIXES = ("grpc.health.", "grpc.reflection.", "opentelemetry.proto.")


@dataclass(frozen=True)
class TracingConfig:
    """How a process traces, read from the environment by `from_env`."""

    service_name: str
    protocol: str = "grpc"

    def __post_init__(self) -> None:
        if self.protocol not in _PROTOCOLS:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {self.protocol!r} is not one of {', '.join(_PROTOCOLS)}")

    @classmethod
    def from_env(cls, role: str, environ: Mapping[str, str] = os.environ) -> TracingConfig | None:
        """The config for a process of this role, or None when no OTLP endpoint is configured."""
        if not any(environ.get(name, "").strip() for name in _ENDPOINT_VARIABLES):
            return None
        protocol = next((environ[name] for name in _PROTOCOL_VARIABLES if environ.get(name, "").strip()), "grpc")
        return cls(service_name=f"tandem-{role}", protocol=protocol.strip().lower())


def capture_content(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether prompts and completions may be recorded on spans (an explicit opt-in)."""
    return environ.get(_CAPTURE_CONTENT_VARIABLE, "").strip().lower() == "true"


class Tracing:
    """The tracer provider of a process whose tracing is on; `shutdown` exports what is left."""

    def __init__(self, config: TracingConfig) -> None:
        # Our service name overrides OTEL_SERVICE_NAME: attributes given here win over the environment's.
        resource = Resource.create({SERVICE_NAME: config.service_name})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(config.protocol)))

    def shutdown(self) -> None:
        """Flush the spans still batched and stop exporting (call it before the process exits)."""
        self.provider.shutdown()


def setup_tracing(role: str, environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """Turn tracing on for this process when an OTLP endpoint is configured; None when it stays off.

    Call it once, before the process creates its gRPC server and channels (only those created
    afterwards carry trace context). ValueError for an unsupported OTLP protocol.
    """
    config = TracingConfig.from_env(role, environ)
    if config is None:
        return None
    tracing = Tracing(config)
    trace.set_tracer_provider(tracing.provider)
    _instrument_grpc()
    global _tracing_on
    _tracing_on = True
    log.info("tracing on: service %s, OTLP over %s", config.service_name, config.protocol)
    return tracing


def traced_http(app: Any) -> Any:
    """The ASGI app with a SERVER span per HTTP request (a client's W3C `traceparent` header
    continues its trace) when `setup_tracing` turned tracing on; the app itself otherwise.
    Health checks and scrapes are not traced."""
    if not _tracing_on:
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    return OpenTelemetryMiddleware(app, excluded_urls="health,metrics")


def _exporter(protocol: str):
    # Each exporter reads its endpoint, headers, timeout and TLS settings from OTEL_* itself.
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def _instrument_grpc() -> None:
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
        filters,
    )

    traced = filters.negate(filters.any_of(
        *(filters.method_name(name) for name in _UNTRACED_METHODS),
        *(filters.service_prefix(prefix) for prefix in _UNTRACED_SERVICE_PREFIXES),
    ))
    GrpcAioInstrumentorServer(filter_=traced).instrument()
    GrpcAioInstrumentorClient(filter_=traced).instrument()
    # Sync channels: the gRPC KV transfer backend's Handshake and Push.
    GrpcInstrumentorClient(filter_=traced).instrument()
