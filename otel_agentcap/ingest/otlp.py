"""OTLP spans as objects the agentcap mapping reads (pure conversion, no I/O).

:func:`spans_from_otlp` converts an ``ExportTraceServiceRequest`` (or its serialized protobuf
bytes) into :class:`OtlpSpan` objects that satisfy
:class:`otel_agentcap.pipeline.mapping.SpanLike`, so
``batch_from_spans(spans_from_otlp(request))`` yields the same events, agents and runs as mapping
the SDK spans the request was encoded from (in the request's span order). The server
(:mod:`otel_agentcap.ingest.server`) reads requests span by span with
:mod:`otel_agentcap.ingest.wire` and converts each with :func:`span_from_proto`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_agentcap.attributes import SPAN_EVENT_PREFIX
from otel_agentcap.model import from_fields

# OTLP span kinds are the API's plus one (0 is SPAN_KIND_UNSPECIFIED, read as INTERNAL).
_KINDS: Final = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: SpanKind.INTERNAL,
    trace_pb2.Span.SPAN_KIND_SERVER: SpanKind.SERVER,
    trace_pb2.Span.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    trace_pb2.Span.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    trace_pb2.Span.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}


# --- conversion -------------------------------------------------------------------------------


# NamedTuples, not frozen dataclasses: the ingest builds one of each per span, and a NamedTuple
# is built in C (a frozen dataclass sets every field through object.__setattr__).


class OtlpSpanContext(NamedTuple):
    """Trace and span id of a span, as the integers the SDK's ``SpanContext`` holds."""

    trace_id: int
    span_id: int


class OtlpSpanEvent(NamedTuple):
    """An event inside a span (``Span.Event``)."""

    name: str
    attributes: Mapping[str, Any]
    timestamp: int


class OtlpScope(NamedTuple):
    """The instrumentation scope that recorded a span."""

    name: str
    version: str | None = None


_NO_RESOURCE: Final[Mapping[str, Any]] = MappingProxyType({})


class OtlpSpan(NamedTuple):
    """One span of an OTLP request, shaped like the parts of an SDK ``ReadableSpan`` that
    :mod:`otel_agentcap.pipeline.mapping` reads (it satisfies ``mapping.SpanLike``)."""

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
    resource_attributes: Mapping[str, Any] = _NO_RESOURCE


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
    out: dict[str, Any] = {}
    for kv in values:
        value = kv.value
        # Strings first, inline: nearly every attribute of a stamped span is one.
        if value.WhichOneof("value") == "string_value":
            out[kv.key] = value.string_value
        else:
            out[kv.key] = decode_value(value)
    return out


def id_problem(span: trace_pb2.Span) -> str | None:
    """Why the ids of ``span`` cannot be stored, or None: a trace id of 16 bytes and a span id
    of 8, neither all zero, and a parent span id that is empty (a root span), all zero (read as
    empty, as some senders mark a root) or 8 bytes. A parent id of another length is not
    dropped: the span would be stored as a root, its place in the trace lost without a word."""
    for name, value, size in (("trace id", span.trace_id, 16), ("span id", span.span_id, 8)):
        if len(value) != size:
            return f"{name} is {len(value)} bytes, not {size}"
        if not any(value):
            return f"{name} is all zero"
    parent = span.parent_span_id
    if parent and len(parent) != 8:
        return f"parent span id is {len(parent)} bytes, not 8"
    return None


def _span_context(trace_id: bytes, span_id: bytes) -> OtlpSpanContext | None:
    """The ids as integers; None unless they are valid (16 and 8 bytes, not all zero)."""
    if len(trace_id) != 16 or len(span_id) != 8:
        return None
    trace = int.from_bytes(trace_id, "big")
    span = int.from_bytes(span_id, "big")
    return _new_context((trace, span)) if trace and span else None


_new_context = from_fields(OtlpSpanContext)
_new_span = from_fields(OtlpSpan)
#: The statuses without a description, built once (``Status`` is immutable).
_PLAIN_STATUS: Final = {code.value: Status(code) for code in StatusCode}


def _status(status: trace_pb2.Status) -> Status:
    code = status.code
    if code != 2:  # UNSET or OK (an unknown code reads as UNSET): the API keeps no description
        return _PLAIN_STATUS[code] if code in _PLAIN_STATUS else _PLAIN_STATUS[0]
    return Status(StatusCode.ERROR, status.message or None)


def _events(span: trace_pb2.Span, all_events: bool) -> tuple[OtlpSpanEvent, ...]:
    if not span.events:
        return ()
    return tuple(
        OtlpSpanEvent(e.name, decode_attributes(e.attributes), e.time_unix_nano)
        for e in span.events
        if all_events or e.name.startswith(SPAN_EVENT_PREFIX)
    )


def span_from_proto(
    span: trace_pb2.Span,
    scope: OtlpScope,
    resource: Mapping[str, Any],
    *,
    all_events: bool = True,
) -> OtlpSpan | None:
    """One OTLP span as an :class:`OtlpSpan`; None when its trace, span or parent span id is
    invalid (:func:`id_problem` says why).

    With ``all_events=False`` only the span events the mapping reads (named
    ``agentcap.*``) are kept: the ingest keeps a chunk of spans, and span events of other
    instrumentations, two bytes each on the wire, would cost a hundred times that there."""
    context = _span_context(span.trace_id, span.span_id)
    if context is None or (span.parent_span_id and len(span.parent_span_id) != 8):
        return None  # invalid ids: no SDK span has them, and the mapping would misreport them
    parent_id = span.parent_span_id
    return _new_span(
        (
            span.name,
            context,
            _span_context(span.trace_id, parent_id) if parent_id else None,
            _KINDS.get(span.kind, SpanKind.INTERNAL),
            decode_attributes(span.attributes),
            _events(span, all_events),
            span.start_time_unix_nano or None,
            span.end_time_unix_nano or None,
            _status(span.status),
            scope,
            resource,
        )
    )


def parse_request(data: bytes | ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """The request itself, or the request serialized in ``data``; raises
    ``google.protobuf.message.DecodeError`` on bytes that are not one."""
    if isinstance(data, ExportTraceServiceRequest):
        return data
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return request


#: A span with either attribute is for the log: an event's span, or a run's root span.
FOR_THE_LOG: Final = frozenset({"agentcap.event.id", "agentcap.run.root"})


def _items(
    data: bytes | ExportTraceServiceRequest,
) -> Iterator[tuple[OtlpSpan | None, trace_pb2.Span]]:
    request = parse_request(data)
    for resource_spans in request.resource_spans:
        resource = decode_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = OtlpScope(scope_spans.scope.name, scope_spans.scope.version or None)
            for span in scope_spans.spans:
                yield span_from_proto(span, scope, resource), span


def iter_spans(data: bytes | ExportTraceServiceRequest) -> Iterator[OtlpSpan]:
    """The spans of an OTLP trace request, in request order; spans without valid ids are skipped
    (:func:`read_spans` says which)."""
    for converted, _ in _items(data):
        if converted is not None:
            yield converted


def read_spans(data: bytes | ExportTraceServiceRequest) -> tuple[list[OtlpSpan], list[str]]:
    """The spans of an OTLP trace request, and why each span for the log (one that holds an
    agentcap event or is a run's root span) was left out: its ids are invalid
    (:func:`id_problem`). Spans of other instrumentations with invalid ids are skipped."""
    spans: list[OtlpSpan] = []
    left_out: list[str] = []
    for converted, span in _items(data):
        if converted is not None:
            spans.append(converted)
        elif any(kv.key in FOR_THE_LOG for kv in span.attributes):
            left_out.append(f"span cannot be stored: {id_problem(span)}")
    return spans, left_out


def spans_from_otlp(data: bytes | ExportTraceServiceRequest) -> list[OtlpSpan]:
    """The spans of an OTLP ``ExportTraceServiceRequest`` (or its protobuf bytes) as objects the
    agentcap mapping reads like SDK spans: ``batch_from_spans(spans_from_otlp(request))``."""
    return list(iter_spans(data))
