"""The gateway's record of what a client received, and its rule for moving a request mid-stream."""

from __future__ import annotations

import logging

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.resume import Resumed
from services.common.chunk import Chunk, Timings, Usage
from services.common.errors import StatusError
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import MigrationPolicy, StreamProgress
from services.gateway.request import GenerateRequest, TextPrompt
from services.gateway.telemetry import RequestObservation

_DEAD = StatusError(grpc.StatusCode.UNAVAILABLE, "Socket closed")


def _chunk(token_ids: tuple[int, ...], text: str, final: bool = False) -> Chunk:
    return Chunk("r", token_ids, text, (), "length" if final else None,
                 Usage(5, 4, 0) if final else None,
                 Timings(ttft_s=0.5, tpot_s=0.001, prefill_queue_s=0.1, prefill_compute_s=0.2, kv_wait_s=0.0,
                         e2e_s=0.6) if final else None)


def test_resumes_from_every_token_and_character_the_client_has():
    progress = StreamProgress(MigrationPolicy())
    assert progress.resumed() is None and progress.context([1, 2]) == [1, 2]
    progress.delivered(_chunk((7,), "Gr"))
    progress.delivered(_chunk((8, 9), ""))  # text held back by the worker: a possible stop string, say
    assert progress.resumed() == Resumed((7, 8, 9), 2)
    assert progress.context([1, 2]) == [1, 2, 7, 8, 9]


def test_moves_on_only_when_the_worker_is_unavailable_and_within_the_limit():
    progress = StreamProgress(MigrationPolicy(max_migrations=2))
    assert not progress.migrate(StatusError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert not progress.migrate(StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    assert progress.migrate(_DEAD) and progress.migrate(_DEAD)
    assert not progress.migrate(_DEAD)
    assert progress.migrations == 2
    assert not StreamProgress(MigrationPolicy(max_migrations=0)).migrate(_DEAD)
    finished = StreamProgress(MigrationPolicy())
    finished.delivered(_chunk((1,), "a", final=True))
    assert not finished.migrate(_DEAD)  # the stream broke after its end: nothing to resume
    with pytest.raises(ValueError, match="max_migrations: must be >= 0"):
        MigrationPolicy(max_migrations=-1)


def test_after_a_migration_the_final_timings_cover_the_whole_stream():
    unmoved = StreamProgress(MigrationPolicy())
    final = _chunk((3,), "c", final=True)
    assert unmoved.delivered(final) is final  # the worker's own figures when nothing moved

    moved = StreamProgress(MigrationPolicy())
    moved.delivered(_chunk((1,), "a"))
    assert moved.migrate(_DEAD)
    moved.delivered(_chunk((2,), "b"))
    timings = moved.delivered(final).timings
    assert timings is not None
    # The last worker saw one token in 0.6 s; the client's stream began before it and holds three.
    assert timings.e2e_s >= timings.ttft_s >= 0
    assert timings.tpot_s == pytest.approx((timings.e2e_s - timings.ttft_s) / 2)
    assert (timings.prefill_queue_s, timings.prefill_compute_s) == (0.1, 0.2)  # the re-prefill's


def test_a_migration_is_on_the_span_in_the_metrics_and_in_the_log(caplog):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = GatewayMetrics("m")
    with caplog.at_level(logging.WARNING), provider.get_tracer("test").start_as_current_span("request"):
        observation = RequestObservation(metrics, "r1", GenerateRequest(TextPrompt("Hi"), request_id="r1"), False)
        observation.migrated("decode:1", "UNAVAILABLE", "Socket closed", 12, 1)
        observation.close()
    assert metrics.registry.get_sample_value("tandem:request_migrations_total",
                                            {"model_name": "m", "model_version": ""}) == 1
    [span] = exporter.get_finished_spans()
    [event] = span.events
    assert event.name == "migrated" and dict(event.attributes) == {
        "tandem.decode.address": "decode:1", "error.type": "UNAVAILABLE", "tandem.detail": "Socket closed",
        "tandem.delivered_tokens": 12}
    assert span.attributes["tandem.migrations"] == 1
    assert "request r1: decode worker decode:1 failed after 12 output tokens" in caplog.text
