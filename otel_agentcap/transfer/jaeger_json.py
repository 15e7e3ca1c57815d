"""A run's trace in the JSON shape of the Jaeger query API's ``/api/traces/{id}`` response, which
the Jaeger UI opens from a file (Search, Upload) with no backend: one entry of ``data`` per trace
id (a run is one trace; logs of earlier versions may hold several), spans with ``references``
(``CHILD_OF`` the parent span, ``FOLLOWS_FROM`` each causal-parent link, as the collector's Jaeger
translator renders OpenTelemetry links), ``processes`` by service, and tags as that translator
writes them (``span.kind``, ``otel.status_code``, ``error``, ``otel.scope.name``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, BinaryIO

from otel_agentcap.transfer.json_text import TextOut, compact
from otel_agentcap.transfer.traces import Attribute, RunTrace, TraceSpan

UNKNOWN_SERVICE = "unknown_service"
_KIND_NAMES = {1: "server", 2: "client", 3: "producer", 4: "consumer"}
_STATUS_NAMES = {1: "OK", 2: "ERROR"}


def _tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, tuple | list):
        return {"key": key, "type": "string", "value": json.dumps(list(value))}
    return {"key": key, "type": "string", "value": str(value)}


def _tags(attributes: Sequence[Attribute]) -> list[dict[str, Any]]:
    return [_tag(key, value) for key, value in attributes]


def _span(span: TraceSpan, process_id: str) -> dict[str, Any]:
    envelope = span.envelope
    references = []
    if envelope.parent_span_id:
        references.append(
            {
                "refType": "CHILD_OF",
                "traceID": envelope.trace_id,
                "spanID": envelope.parent_span_id,
            }
        )
    for link in span.links:
        references.append(
            {"refType": "FOLLOWS_FROM", "traceID": link.trace_id, "spanID": link.span_id}
        )
    tags = _tags(span.attributes)
    if envelope.kind in _KIND_NAMES:
        tags.append(_tag("span.kind", _KIND_NAMES[envelope.kind]))
    if envelope.scope_name:
        tags.append(_tag("otel.scope.name", envelope.scope_name))
    if envelope.status_code in _STATUS_NAMES:
        tags.append(_tag("otel.status_code", _STATUS_NAMES[envelope.status_code]))
    if envelope.status_message:
        tags.append(_tag("otel.status_description", envelope.status_message))
    if envelope.status_code == 2:
        tags.append(_tag("error", True))
    return {
        "traceID": envelope.trace_id,
        "spanID": envelope.span_id,
        "operationName": envelope.name,
        "references": references,
        "startTime": envelope.start_us,
        "duration": max(0, envelope.end_us - envelope.start_us),
        "tags": tags,
        "logs": [
            {
                "timestamp": event.time_us,
                "fields": _tags((("event", event.name), *event.attributes)),
            }
            for event in span.events
        ],
        "processID": process_id,
        "warnings": None,
        "flags": 1,
    }


def _processes(spans: Sequence[TraceSpan]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The processes of one trace's ``spans`` (one per service, ``p1``, ``p2``, ... in order of
    first use) and each span's process id."""
    processes: dict[str, dict[str, Any]] = {}
    by_service: dict[str, str] = {}
    process_ids = []
    for span in spans:
        service = span.envelope.service_name or UNKNOWN_SERVICE
        process_id = by_service.get(service)
        if process_id is None:
            process_id = by_service[service] = f"p{len(by_service) + 1}"
            processes[process_id] = {"serviceName": service, "tags": []}
        process_ids.append(process_id)
    return processes, process_ids


def to_jaeger(trace: RunTrace) -> dict[str, Any]:
    """The ``/api/traces`` response body holding the run's trace(s)."""
    data = []
    for trace_id in trace.trace_ids:
        spans = [s for s in trace.spans if s.envelope.trace_id == trace_id]
        processes, process_ids = _processes(spans)
        out_spans = [_span(span, pid) for span, pid in zip(spans, process_ids, strict=True)]
        data.append(
            {"traceID": trace_id, "spans": out_spans, "processes": processes, "warnings": None}
        )
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


def dumps(trace: RunTrace) -> bytes:
    return (json.dumps(to_jaeger(trace), ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def write(trace: RunTrace, out: BinaryIO) -> int:
    """Write the bytes :func:`dumps` gives to ``out`` a span at a time (the document is never
    whole in memory; the trace is); returns how many were written."""
    text = TextOut(out)
    emit = text.emit
    emit('{"data":[')
    for number, trace_id in enumerate(trace.trace_ids):
        spans = [s for s in trace.spans if s.envelope.trace_id == trace_id]
        processes, process_ids = _processes(spans)
        emit(("," if number else "") + '{"traceID":' + compact(trace_id) + ',"spans":[')
        for position, (span, process_id) in enumerate(zip(spans, process_ids, strict=True)):
            emit(("," if position else "") + compact(_span(span, process_id)))
        emit('],"processes":' + compact(processes) + ',"warnings":null}')
    emit('],"total":0,"limit":0,"offset":0,"errors":null}\n')
    return text.size
