"""The old import path of :mod:`otel_agentcap.pipeline.mapping`: its names, re-exported."""

from otel_agentcap.pipeline.mapping import (
    SpanCheck,
    SpanLike,
    SpanRejected,
    agents_from_span,
    batch_from_spans,
    declared_run_attributes,
    events_from_span,
    span_record,
    wall_time,
)

__all__ = [
    "SpanCheck",
    "SpanLike",
    "SpanRejected",
    "agents_from_span",
    "batch_from_spans",
    "declared_run_attributes",
    "events_from_span",
    "span_record",
    "wall_time",
]
