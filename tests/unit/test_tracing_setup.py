"""Tracing is configured by OTEL_* variables: off without an endpoint (nothing installed), and when
on, OTLP over HTTP reaches a real receiver (the gRPC protocol is exercised by the mesh test)."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider

from services.observability.metrics import default_metrics_port
from services.observability.tracing import Tracing, TracingConfig, capture_content, setup_tracing


def test_off_without_an_endpoint_installs_nothing():
    server, channel = grpc.aio.server, grpc.aio.insecure_channel
    for environ in ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, {"OTEL_SERVICE_NAME": "x"}):
        assert setup_tracing("prefill", environ) is None
    assert grpc.aio.server is server and grpc.aio.insecure_channel is channel
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


def test_config_from_the_standard_variables():
    assert TracingConfig.from_env("gateway", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}) == TracingConfig(
        "tandem-gateway", "grpc")
    traces_only = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert TracingConfig.from_env("decode", traces_only) == TracingConfig("tandem-decode", "http/protobuf")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        TracingConfig.from_env("worker", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_PROTOCOL":
                                          "http/json"})
    assert capture_content({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "True"})
    assert not capture_content({})


class _Collector(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, ExportTraceServiceRequest]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, ExportTraceServiceRequest.FromString(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_http_export_names_the_service_whatever_otel_service_name_says(monkeypatch):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{httpd.server_port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "shared")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        tracing = Tracing(TracingConfig.from_env("worker", os.environ))
        tracing.provider.get_tracer("test").start_span("hello").end()
        tracing.shutdown()  # flushes the batch
    finally:
        httpd.shutdown()
        httpd.server_close()
    [(path, request)] = _Collector.received
    assert path == "/v1/traces"
    [resource_spans] = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "tandem-worker"
    assert resource["deployment.environment"] == "staging"
    assert [s.name for s in resource_spans.scope_spans[0].spans] == ["hello"]


def test_metrics_port_defaults_to_the_grpc_port_plus_1000():
    assert default_metrics_port(50061, None) == 51061
    assert default_metrics_port(0, None) == 0
    assert default_metrics_port(50061, 0) == 0
    assert default_metrics_port(50061, 9100) == 9100
    with pytest.raises(ValueError, match="--metrics-port"):
        default_metrics_port(65000, None)
    with pytest.raises(ValueError, match="--metrics-port"):
        default_metrics_port(50061, 70000)
