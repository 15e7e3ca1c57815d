"""Span records: what the durable queue stores for one ended span, and how it is read back.

A record is made on the thread that ends the span, so it must be cheap: it is the span's data as
the SDK holds it, not the event rows (the mapping to rows runs later, on the delivery thread,
exactly as it runs for spans that never went through the queue). The payload is one byte naming
the record kind, then JSON (documented, safe to read, and the C encoder of the standard library
is the fastest way Python has to serialise it)::

    b"S" + JSON array [
        name, trace_id, span_id, parent_span_id | null,   # ids as integers, as the SDK has them
        start_time, end_time,                             # ns since the epoch
        scope_name | null, scope_version | null,
        status_code, status_description | null,          # StatusCode value: 0 unset, 1 ok, 2 error
        attributes,                                       # object; sequences become arrays
        events,                                           # [[name, timestamp, attributes], ...]
        links,                                            # [[trace_id, span_id, attributes], ...]
        kind,                                             # SpanKind value
        flags,                                            # 1: the span's own event was queued
    ]                                                     #    when it started (see below)

A span whose own event is complete when it starts and that may stay open for long (an agent
execution's ``invoke_agent`` span, whose event is ``agent_start``) is queued twice: when it
starts (``end_time`` null, no closing event), so a process that dies while the agent runs still
delivers ``agent_start``; and when it ends, with flag 1, which tells delivery not to send its own
event again (:attr:`StoredSpan.own_event_queued`).

Readers take the fields they know and ignore any that a newer version appends, so a later
version of the library reads what an earlier one wrote. A record of a kind a reader does not know
raises :class:`UnknownRecord` (the queue keeps it for a reader that does).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap.span_attributes import attributes_of, has_events

_logger = logging.getLogger(__name__)

SPAN_RECORD: Final = b"S"
_dumps = json.dumps  # the module-level default encoder is cached in C; keyword arguments are not
_loads = json.loads
_OUTCOME: Final = attr.OUTCOME
_EVENT_ID: Final = attr.EVENT_ID
_SPAN_EVENT_PREFIX: Final = attr.SPAN_EVENT_PREFIX


class UnknownRecord(ValueError):
    """A record of a kind (or an encoding) this version cannot read."""


class StoredContext(NamedTuple):
    trace_id: int
    span_id: int
    is_remote: bool = False


class StoredScope(NamedTuple):
    name: str
    version: str | None = None


class StoredStatus(NamedTuple):
    status_code: StatusCode
    description: str | None = None


class StoredEvent(NamedTuple):
    name: str
    timestamp: int
    attributes: Mapping[str, AttributeValue]


class StoredLink(NamedTuple):
    context: StoredContext
    attributes: Mapping[str, AttributeValue]


_STATUS: Final = {code.value: StoredStatus(code) for code in StatusCode}
_KINDS: Final = {kind.value: kind for kind in SpanKind}


#: Record flag: the span's own event was queued when the span started.
OWN_EVENT_QUEUED: Final = 1


class StoredSpan:
    """A span read back from the queue: the parts of an SDK ``ReadableSpan`` that the mapping
    (``otel_agentcap.mapping.SpanLike``) and exporters read."""

    __slots__ = (
        "attributes",
        "context",
        "end_time",
        "events",
        "instrumentation_scope",
        "kind",
        "links",
        "name",
        "own_event_queued",
        "parent",
        "start_time",
        "status",
    )

    def __init__(
        self,
        name: str,
        context: StoredContext,
        parent: StoredContext | None,
        start_time: int | None,
        end_time: int | None,
        instrumentation_scope: StoredScope | None,
        status: StoredStatus,
        attributes: dict[str, AttributeValue],
        events: Sequence[StoredEvent] = (),
        links: Sequence[StoredLink] = (),
        kind: SpanKind = SpanKind.INTERNAL,
        own_event_queued: bool = False,
    ) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.start_time = start_time
        self.end_time = end_time
        self.instrumentation_scope = instrumentation_scope
        self.status = status
        self.attributes = attributes
        self.events = events
        self.links = links
        self.kind = kind
        #: The span's own event went into the queue when the span started: not sent again.
        self.own_event_queued = own_event_queued

    def __repr__(self) -> str:
        return f"StoredSpan({self.name!r}, event={self.attributes.get(_EVENT_ID)!r})"


def holds_events(span: Any) -> bool:
    """Whether ``span`` records event-log events (it carries agentcap's stamp)."""
    return _EVENT_ID in attributes_of(span)


def event_count(span: Any, attributes: Mapping[str, AttributeValue] | None = None) -> int:
    """How many events a stamped span holds (its own, the closing one, legacy span events):
    exact for what the capture API writes, used for counts before the mapping runs."""
    if attributes is None:
        attributes = attributes_of(span)
    count = 1 + (_OUTCOME in attributes)
    if has_events(span):
        count += sum(1 for e in span.events if e.name.startswith(_SPAN_EVENT_PREFIX))
    return count


def _event_fields(span: Any) -> list[Any]:
    return [
        [e.name, e.timestamp, dict(e.attributes or {})]
        for e in span.events
        if e.name.startswith(_SPAN_EVENT_PREFIX)
    ]


def _link_fields(links: Sequence[Any]) -> list[Any]:
    return [
        [link.context.trace_id, link.context.span_id, dict(link.attributes or {})] for link in links
    ]


def _jsonable(value: object) -> object:
    """Last resort for a value the JSON encoder refuses (an attribute set around the SDK's own
    checks): its text, so the rest of the record survives."""
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, tuple | list | set | frozenset):
        return list(value)
    return str(value)


def encode_span(
    span: Any, attributes: Mapping[str, AttributeValue] | None = None, *, flags: int = 0
) -> bytes:
    """The record payload of a span (see the module doc): an ended one, or one that just
    started (its end time is then null)."""
    if attributes is None:
        attributes = attributes_of(span)
    if type(attributes) is not dict:
        attributes = dict(attributes)  # a read-only view (the encoder takes dicts only)
    context = span.context
    parent = span.parent
    scope = span.instrumentation_scope
    status = span.status
    links = span.links
    fields = (
        span.name,
        context.trace_id,
        context.span_id,
        parent.span_id if parent is not None else None,
        span.start_time,
        span.end_time,
        scope.name if scope is not None else None,
        scope.version if scope is not None else None,
        status.status_code.value,
        status.description,
        attributes,
        _event_fields(span) if has_events(span) else (),
        _link_fields(links) if links else (),
        span.kind.value,
        flags,
    )
    try:
        text = _dumps(fields)
    except (TypeError, ValueError):
        text = json.dumps(fields, default=_jsonable)
    return SPAN_RECORD + text.encode()


def _context(trace_id: int, span_id: int) -> StoredContext:
    return StoredContext(trace_id, span_id)


def decode_span(payload: bytes) -> StoredSpan:
    """The span a record payload holds; raises :class:`UnknownRecord` for anything else."""
    if payload[:1] != SPAN_RECORD:
        raise UnknownRecord(f"unknown record kind {payload[:1]!r}")
    try:
        fields = _loads(payload[1:])
        (
            name,
            trace_id,
            span_id,
            parent_id,
            start_time,
            end_time,
            scope_name,
            scope_version,
            status_code,
            status_description,
            attributes,
            events,
            links,
            kind,
        ) = fields[:14]
        flags = fields[14] if len(fields) > 14 else 0
    except (ValueError, TypeError) as exc:
        raise UnknownRecord(f"unreadable span record: {exc}") from None
    status = _STATUS.get(status_code, _STATUS[0])
    if status_description is not None:
        status = StoredStatus(status.status_code, status_description)
    return StoredSpan(
        name,
        StoredContext(trace_id, span_id),
        StoredContext(trace_id, parent_id) if parent_id is not None else None,
        start_time,
        end_time,
        StoredScope(scope_name, scope_version) if scope_name is not None else None,
        status,
        attributes,
        [StoredEvent(e[0], e[1], e[2]) for e in events] if events else (),
        [StoredLink(_context(link[0], link[1]), link[2]) for link in links] if links else (),
        _KINDS.get(kind, SpanKind.INTERNAL),
        bool(flags & OWN_EVENT_QUEUED) if type(flags) is int else False,
    )
