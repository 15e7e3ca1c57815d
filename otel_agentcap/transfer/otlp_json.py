"""A run's trace as OTLP JSON (an ``ExportTraceServiceRequest`` in the OTLP/JSON encoding: hex
trace and span ids, 64-bit integers as strings, enums as numbers), which any OTLP tool reads, and
the reading of such a file back into spans the agentcap mapping understands."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_agentcap.attributes import LINK_EVENT_ID
from otel_agentcap.transfer.json_text import TextOut, compact
from otel_agentcap.transfer.traces import Attribute, RunTrace, TraceSpan


def any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, tuple | list):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def key_values(attributes: Sequence[Attribute]) -> list[dict[str, Any]]:
    return [{"key": key, "value": any_value(value)} for key, value in attributes]


def _span(span: TraceSpan) -> dict[str, Any]:
    envelope = span.envelope
    out: dict[str, Any] = {"traceId": envelope.trace_id, "spanId": envelope.span_id}
    if envelope.parent_span_id:
        out["parentSpanId"] = envelope.parent_span_id
    out["name"] = envelope.name
    out["kind"] = envelope.kind + 1  # OTLP counts SPAN_KIND_UNSPECIFIED as 0
    out["startTimeUnixNano"] = str(envelope.start_us * 1000)
    out["endTimeUnixNano"] = str(envelope.end_us * 1000)
    out["attributes"] = key_values(span.attributes)
    if span.events:
        out["events"] = [
            {
                "timeUnixNano": str(event.time_us * 1000),
                "name": event.name,
                "attributes": key_values(event.attributes),
            }
            for event in span.events
        ]
    if span.links:
        out["links"] = [
            {
                "traceId": link.trace_id,
                "spanId": link.span_id,
                "attributes": key_values([(LINK_EVENT_ID, link.event_id)]),
            }
            for link in span.links
        ]
    status: dict[str, Any] = {}
    if envelope.status_message:
        status["message"] = envelope.status_message
    if envelope.status_code:
        status["code"] = envelope.status_code
    out["status"] = status
    return out


def to_otlp(trace: RunTrace) -> dict[str, Any]:
    """The ``ExportTraceServiceRequest`` of ``trace`` as OTLP/JSON: one resource per service, one
    scope per instrumentation scope, spans in start order."""
    groups: dict[str | None, dict[str | None, list[TraceSpan]]] = {}
    for span in trace.spans:
        scopes = groups.setdefault(span.envelope.service_name, {})
        scopes.setdefault(span.envelope.scope_name, []).append(span)
    resource_spans = []
    for service, scopes in groups.items():
        resource = {"attributes": key_values([("service.name", service)] if service else [])}
        resource_spans.append(
            {
                "resource": resource,
                "scopeSpans": [
                    {
                        "scope": {"name": scope} if scope else {},
                        "spans": [_span(span) for span in spans],
                    }
                    for scope, spans in scopes.items()
                ],
            }
        )
    return {"resourceSpans": resource_spans}


def dumps(trace: RunTrace) -> bytes:
    return (json.dumps(to_otlp(trace), ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def write(trace: RunTrace, out: BinaryIO) -> int:
    """Write the bytes :func:`dumps` gives to ``out`` a span at a time (the document is never
    whole in memory; the trace is); returns how many were written."""
    groups: dict[str | None, dict[str | None, list[TraceSpan]]] = {}
    for span in trace.spans:
        scopes = groups.setdefault(span.envelope.service_name, {})
        scopes.setdefault(span.envelope.scope_name, []).append(span)
    text = TextOut(out)
    emit = text.emit
    emit('{"resourceSpans":[')
    for number, (service, scopes) in enumerate(groups.items()):
        resource = {"attributes": key_values([("service.name", service)] if service else [])}
        emit(("," if number else "") + '{"resource":' + compact(resource) + ',"scopeSpans":[')
        for index, (scope, spans) in enumerate(scopes.items()):
            head = {"name": scope} if scope else {}
            emit(("," if index else "") + '{"scope":' + compact(head) + ',"spans":[')
            for position, span in enumerate(spans):
                emit(("," if position else "") + compact(_span(span)))
            emit("]}")
        emit("]}")
    emit("]}\n")
    return text.size


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class JsonSpanContext:
    trace_id: int
    span_id: int


@dataclass(frozen=True, slots=True)
class JsonSpanEvent:
    name: str
    attributes: Mapping[str, Any]
    timestamp: int


@dataclass(frozen=True, slots=True)
class JsonScope:
    name: str
    version: str | None = None


@dataclass(frozen=True, slots=True)
class JsonSpan:
    """A span read from OTLP/JSON, shaped like what ``mapping`` reads of an SDK span."""

    name: str
    context: JsonSpanContext
    parent: JsonSpanContext | None
    kind: SpanKind
    attributes: Mapping[str, Any]
    events: tuple[JsonSpanEvent, ...]
    start_time: int | None
    end_time: int | None
    status: Status
    instrumentation_scope: JsonScope
    resource_attributes: Mapping[str, Any] = field(default_factory=dict)


def _value(value: Mapping[str, Any]) -> Any:
    if "stringValue" in value:
        return str(value["stringValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return tuple(_value(v) for v in (value["arrayValue"] or {}).get("values", ()))
    if "kvlistValue" in value:
        return _attributes((value["kvlistValue"] or {}).get("values", ()))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None


def _attributes(values: Any) -> dict[str, Any]:
    return {str(kv["key"]): _value(kv.get("value") or {}) for kv in values or ()}


def _id(text: Any, size: int) -> int:
    raw = bytes.fromhex(str(text or ""))
    if len(raw) != size:
        raise ValueError(f"not a {size}-byte id: {text!r}")
    return int.from_bytes(raw, "big")


def _nanos(value: Any, what: str) -> int:
    """A time in nanoseconds since the epoch, as OTLP holds it (a ``fixed64``)."""
    nanos = int(value or 0)
    if not 0 <= nanos < 2**64:
        raise ValueError(f"{what} {str(value)[:40]} is not a 64-bit count of nanoseconds")
    return nanos


_KINDS = {
    1: SpanKind.INTERNAL,
    2: SpanKind.SERVER,
    3: SpanKind.CLIENT,
    4: SpanKind.PRODUCER,
    5: SpanKind.CONSUMER,
}


def spans_from_json(data: Mapping[str, Any]) -> list[JsonSpan]:
    """The spans of an OTLP/JSON ``ExportTraceServiceRequest`` (or ``TracesData``); raises
    ``ValueError`` (``KeyError``, ``TypeError``, ``AttributeError`` where a value is not the
    object a field holds, ``OverflowError`` for an infinite number) on a malformed document."""
    spans: list[JsonSpan] = []
    for resource_spans in data.get("resourceSpans") or ():
        resource = _attributes((resource_spans.get("resource") or {}).get("attributes"))
        for scope_spans in resource_spans.get("scopeSpans") or ():
            scope_data = scope_spans.get("scope") or {}
            scope = JsonScope(str(scope_data.get("name") or ""), scope_data.get("version"))
            for span in scope_spans.get("spans") or ():
                trace_id = _id(span["traceId"], 16)
                parent = span.get("parentSpanId")
                status = span.get("status") or {}
                code = int(status.get("code") or 0)
                status_code = StatusCode(code) if code in (0, 1, 2) else StatusCode.UNSET
                spans.append(
                    JsonSpan(
                        name=str(span.get("name") or ""),
                        context=JsonSpanContext(trace_id, _id(span["spanId"], 8)),
                        parent=JsonSpanContext(trace_id, _id(parent, 8)) if parent else None,
                        kind=_KINDS.get(int(span.get("kind") or 1), SpanKind.INTERNAL),
                        attributes=_attributes(span.get("attributes")),
                        events=tuple(
                            JsonSpanEvent(
                                str(e.get("name") or ""),
                                _attributes(e.get("attributes")),
                                _nanos(e.get("timeUnixNano"), "timeUnixNano"),
                            )
                            for e in span.get("events") or ()
                        ),
                        start_time=_nanos(span.get("startTimeUnixNano"), "startTimeUnixNano")
                        or None,
                        end_time=_nanos(span.get("endTimeUnixNano"), "endTimeUnixNano") or None,
                        status=Status(
                            status_code,
                            (status.get("message") or None)
                            if status_code is StatusCode.ERROR
                            else None,
                        ),
                        instrumentation_scope=scope,
                        resource_attributes=resource,
                    )
                )
    return spans


__all__ = ["JsonSpan", "dumps", "spans_from_json", "to_otlp"]
