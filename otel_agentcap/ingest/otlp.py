"""OTLP spans as objects the agentcap mapping reads (pure conversion, no I/O).

:func:`spans_from_otlp` converts an ``ExportTraceServiceRequest`` (or its serialized protobuf
bytes) into :class:`OtlpSpan` objects that satisfy :class:`otel_agentcap.mapping.SpanLike`, so
``batch_from_spans(spans_from_otlp(request))`` yields the same events, agents and runs as mapping
the SDK spans the request was encoded from (in the request's span order). The server
(:mod:`otel_agentcap.ingest.server`) reads requests span by span with
:mod:`otel_agentcap.ingest.wire` and converts each with :func:`span_from_proto`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.trace import SpanKind, Status, StatusCode

# OTLP span kinds are the API's plus one (0 is SPAN_KIND_UNSPECIFIED, read as INTERNAL).
_KINDS: Final = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: SpanKind.INTERNAL,
    trace_pb2.Span.SPAN_KIND_SERVER: SpanKind.SERVER,
    trace_pb2.Span.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    trace_pb2.Span.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    trace_pb2.Span.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}


# --- conversion -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OtlpSpanContext:
    """Trace and span id of a span, as the integers the SDK's ``SpanContext`` holds."""

    trace_id: int
    span_id: int


@dataclass(frozen=True, slots=True)
class OtlpSpanEvent:
    """An event inside a span (``Span.Event``)."""

    name: str
    attributes: Mapping[str, Any]
    timestamp: int


@dataclass(frozen=True, slots=True)
class OtlpScope:
    """The instrumentation scope that recorded a span."""

    name: str
    version: str | None = None


@dataclass(frozen=True, slots=True)
class OtlpSpan:
    """One span of an OTLP request, shaped like the parts of an SDK ``ReadableSpan`` that
    :mod:`otel_agentcap.mapping` reads (it satisfies ``mapping.SpanLike``)."""

    name: str
    context: OtlpSpanContext
    parent: OtlpSpanContext | None
    kind: SpanKind
    attributes: Mapping[str, Any]
    events: tuple[OtlpSpanEvent, ...]
    start_time: int | None
    end_time: int | None
    status: Status
    instrumentation_scope: OtlpScope
    resource_attributes: Mapping[str, Any] = field(default_factory=dict)


_SCALARS: Final = {
    name: operator.attrgetter(name)
    for name in ("string_value", "bool_value", "int_value", "double_value", "bytes_value")
}


def decode_value(value: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as the Python value the SDK recorded: arrays become tuples (as the
    SDK stores sequences), key-value lists dicts, an empty value ``None``."""
    which = value.WhichOneof("value")
    scalar = _SCALARS.get(which)  # type: ignore[arg-type]
    if scalar is not None:
        return scalar(value)
    if which == "array_value":
        return tuple(decode_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return decode_attributes(value.kvlist_value.values)
    return None  # unset, or a string-table index (profiles only), which traces never use


def decode_attributes(values: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP key-values as a dict; a repeated key keeps its last value, as the SDK would."""
    return {kv.key: decode_value(kv.value) for kv in values}


def _span_context(trace_id: bytes, span_id: bytes) -> OtlpSpanContext | None:
    """The ids as integers; None unless they are valid (16 and 8 bytes, not all zero)."""
    if len(trace_id) != 16 or len(span_id) != 8:
        return None
    context = OtlpSpanContext(int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"))
    return context if context.trace_id and context.span_id else None


def _status(status: trace_pb2.Status) -> Status:
    code = StatusCode(status.code) if status.code in (0, 1, 2) else StatusCode.UNSET
    # The API allows a description only with ERROR.
    description = (status.message or None) if code is StatusCode.ERROR else None
    return Status(code, description)


def span_from_proto(
    span: trace_pb2.Span, scope: OtlpScope, resource: Mapping[str, Any]
) -> OtlpSpan | None:
    """One OTLP span as an :class:`OtlpSpan`; None when its trace or span id is invalid."""
    context = _span_context(span.trace_id, span.span_id)
    if context is None:
        return None  # invalid ids: no SDK span has them, and the mapping would misreport them
    return OtlpSpan(
        name=span.name,
        context=context,
        parent=_span_context(span.trace_id, span.parent_span_id),
        kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
        attributes=decode_attributes(span.attributes),
        events=tuple(
            OtlpSpanEvent(e.name, decode_attributes(e.attributes), e.time_unix_nano)
            for e in span.events
        ),
        start_time=span.start_time_unix_nano or None,
        end_time=span.end_time_unix_nano or None,
        status=_status(span.status),
        instrumentation_scope=scope,
        resource_attributes=resource,
    )


def parse_request(data: bytes | ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """The request itself, or the request serialized in ``data``; raises
    ``google.protobuf.message.DecodeError`` on bytes that are not one."""
    if isinstance(data, ExportTraceServiceRequest):
        return data
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return request


def iter_spans(data: bytes | ExportTraceServiceRequest) -> Iterator[OtlpSpan]:
    """The spans of an OTLP trace request, in request order; spans without valid ids are skipped."""
    request = parse_request(data)
    for resource_spans in request.resource_spans:
        resource = decode_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = OtlpScope(scope_spans.scope.name, scope_spans.scope.version or None)
            for span in scope_spans.spans:
                converted = span_from_proto(span, scope, resource)
                if converted is not None:
                    yield converted


def spans_from_otlp(data: bytes | ExportTraceServiceRequest) -> list[OtlpSpan]:
    """The spans of an OTLP ``ExportTraceServiceRequest`` (or its protobuf bytes) as objects the
    agentcap mapping reads like SDK spans: ``batch_from_spans(spans_from_otlp(request))``."""
    return list(iter_spans(data))
