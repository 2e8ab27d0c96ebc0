"""Spans built after the fact from timestamps a service recorded anyway.

The engine thread never calls OpenTelemetry: it notes `time.perf_counter()` values (queue wait,
compute, per-layer pushes), and the asyncio side turns them into finished spans with explicit
start and end times once the work is done. Every helper is a no-op when tracing is off (the
current span is then the API's non-recording one).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

Attributes = Mapping[str, AttributeValue]

TRACER = trace.get_tracer("tandem")
# perf_counter is what the services measure with; spans want nanoseconds since the epoch.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def epoch_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as nanoseconds since the Unix epoch."""
    return int(perf_s * 1e9) + _EPOCH_OFFSET_NS


def tracing_active() -> bool:
    """Whether the current request is traced (tracing on and sampled)."""
    return trace.get_current_span().is_recording()


def add_span(
    name: str,
    start: float,
    end: float,
    attributes: Attributes | None = None,
    events: Iterable[tuple[str, float, Attributes]] = (),
) -> Span:
    """A finished child of the current span over [start, end] (perf_counter seconds); `events`
    are (name, perf_counter time, attributes)."""
    span = TRACER.start_span(name, attributes=attributes, start_time=epoch_ns(start))
    for event, at, event_attributes in events:
        span.add_event(event, event_attributes, timestamp=epoch_ns(at))
    span.end(end_time=epoch_ns(end))
    return span


def add_event(name: str, at: float, attributes: Attributes | None = None) -> None:
    """An event at a perf_counter time on the current span."""
    trace.get_current_span().add_event(name, attributes, timestamp=epoch_ns(at))


def set_attributes(attributes: Attributes) -> None:
    """Attributes on the current span."""
    trace.get_current_span().set_attributes(attributes)


def set_error(error_type: str, message: str, span: Span | None = None) -> None:
    """Mark a span (the current one by default) failed: status ERROR and `error.type`."""
    span = span or trace.get_current_span()
    span.set_status(Status(StatusCode.ERROR, message))
    span.set_attribute("error.type", error_type)

