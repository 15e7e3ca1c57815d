"""Span records: what the durable queue stores for one span, and how it is read back.

A record is made on the thread that ends the span, so it must be cheap: it is the span's data as
the SDK holds it, not the event rows (the mapping to rows runs later, on the delivery thread,
exactly as it runs for spans that never went through the queue). The payload is one byte naming
the record kind, the length of a header, the header, then text::

    b"M" (or b"S")  u32 little-endian: bytes of the header
    header: a list of the fields below, in marshal format version 4 (kind M) or JSON (kind S) [
        name, trace_id, span_id, parent_span_id | null,   # ids as integers, as the SDK has them
        start_time, end_time | null,                      # ns since the epoch
        scope_name | null, scope_version | null,
        status_code, status_description | null,          # StatusCode value: 0 unset, 1 ok, 2 error
        attributes,                                       # object; sequences become arrays
        events,                                           # [[name, timestamp, attributes], ...]
        links,                                            # [[trace_id, span_id, attributes], ...]
        kind,                                             # SpanKind value
        flags,                                            # 1: the span's own event was queued
                                                          #    when it started (see below)
        texts,                                            # [[attribute, bytes], ...]
        service_name | null,                              # the resource's service.name
    ]
    text: the values of the attributes named in ``texts``, UTF-8, back to back

The header is written with ``marshal`` (format version 4, which every CPython since 3.4 reads
and writes the same way): for the plain values a span holds (str, int of any size, float, bool,
None, tuples, lists, dicts) it is several times faster than JSON both on the ending thread and
on delivery, keeps tuples and exact int and float values as they were, and needs no escaping. A
record holding a value marshal refuses (a ``str`` subclass an instrumentation set, say) is
written with a JSON header instead (kind S; sequences then read back as lists, which the mapping
takes as well). The queue directory is private to the user (``0700``) and every record carries a
checksum; marshal must not read data from anyone else, and does not here.

The attributes that hold JSON text of their own (the event payload and the closing event) go
in the text part as they are, encoded once, and are handed to PostgreSQL untouched. Readers take
the fields they know and ignore any that a newer version appends, so a later version of the
library reads what an earlier one wrote; a record of a kind a reader does not know raises
:class:`UnknownRecord` (the queue keeps it for a reader that does).

A span whose own event is complete when it starts and that may stay open for long (an agent
execution's ``invoke_agent`` span, whose event is ``agent_start``) is queued twice: when it
starts (``end_time`` null, no closing event), so a process that dies while the agent runs still
delivers ``agent_start``; and when it ends, with flag 1, which tells delivery not to send its own
event again (:attr:`StoredSpan.own_event_queued`). When the start record went to memory (the disk
refused it), the end record has the flag too, unless it goes to the disk while the start record
is still waiting in memory: then it carries the event itself (a crash would lose the memory
record, not the disk one).
"""

from __future__ import annotations

import json
import logging
import marshal
import struct
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap.model import from_fields
from otel_agentcap.pipeline.span_attributes import attributes_of, has_events

_logger = logging.getLogger(__name__)

SPAN_RECORD: Final = b"M"
JSON_SPAN_RECORD: Final = b"S"
MARSHAL_VERSION: Final = 4
_U32: Final = struct.Struct("<I")
#: Attributes whose (JSON) text goes in the record's text part rather than its header.
TEXT_ATTRIBUTES: Final = (attr.EVENT_PAYLOAD, attr.OUTCOME)
_marshal_dumps = marshal.dumps
_marshal_loads = marshal.loads
_EVENT_TYPE: Final = attr.EVENT_TYPE
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
_STATUS_VALUES: Final = {code: code.value for code in StatusCode}
_KIND_VALUES: Final = {kind: kind.value for kind in SpanKind}


#: Record flag: the span's own event was queued when the span started.
OWN_EVENT_QUEUED: Final = 1


class StoredSpan(NamedTuple):
    """A span read back from the queue: the parts of an SDK ``ReadableSpan`` that the mapping
    (``otel_agentcap.pipeline.mapping.SpanLike``) and exporters read. A tuple, built in C: delivery
    decodes one per span."""

    name: str
    context: StoredContext
    parent: StoredContext | None
    start_time: int | None
    end_time: int | None
    instrumentation_scope: StoredScope | None
    status: StoredStatus
    attributes: dict[str, AttributeValue]
    events: Sequence[StoredEvent] = ()
    links: Sequence[StoredLink] = ()
    kind: SpanKind = SpanKind.INTERNAL
    #: The span's own event went into the queue when the span started: not sent again.
    own_event_queued: bool = False
    #: What the mapping reads of the span's resource (``service.name``), as for an OTLP span.
    resource_attributes: Mapping[str, Any] = MappingProxyType({})


_new_span = from_fields(StoredSpan)
_new_context = from_fields(StoredContext)
_new_scope = from_fields(StoredScope)


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


#: service.name by resource object (the spans of a process share one resource). Bounded.
_services: dict[int, tuple[object, str | None]] = {}


def _service_name(span: Any) -> str | None:
    resource = getattr(span, "resource", None)
    if resource is None:
        return None
    cached = _services.get(id(resource))
    if cached is not None and cached[0] is resource:
        return cached[1]
    value = (getattr(resource, "attributes", None) or {}).get("service.name")
    name = value if isinstance(value, str) else None
    if len(_services) >= 64:
        _services.clear()
    _services[id(resource)] = (resource, name)
    return name


def encode_span(
    span: Any, attributes: Mapping[str, AttributeValue] | None = None, *, flags: int = 0
) -> bytes:
    """The record payload of a span (see the module doc): an ended one, or one that just
    started (its end time is then null)."""
    if attributes is None:
        attributes = attributes_of(span)
    texts: list[list[Any]] = []
    parts: list[bytes] = []
    for key in TEXT_ATTRIBUTES:
        value = attributes.get(key)
        if type(value) is str:
            data = value.encode("utf-8", "surrogatepass")
            texts.append([key, len(data)])
            parts.append(data)
    if texts or type(attributes) is not dict:
        attributes = dict(attributes)  # a copy without the texts (or of a read-only view)
        for key, _ in texts:
            del attributes[key]
        event_type = attributes.get(_EVENT_TYPE)
        if isinstance(event_type, str) and type(event_type) is not str:
            attributes[_EVENT_TYPE] = str(event_type)  # an EventType member: its plain value
    context = span.context
    parent = span.parent
    scope = span.instrumentation_scope
    status = span.status
    # The SDK's ``links`` property copies the links on every read; its list is read instead
    # when there is one (opentelemetry-sdk 1.34 to 1.45; spans of other kinds have the property).
    links = getattr(span, "_links", None)
    if links is None:
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
        _STATUS_VALUES.get(status.status_code, 0),
        status.description,
        attributes,
        _event_fields(span) if has_events(span) else (),
        _link_fields(links) if links else (),
        _KIND_VALUES.get(span.kind, 0),
        flags,
        texts,
        _service_name(span),
    )
    try:
        header = _marshal_dumps(fields, MARSHAL_VERSION)
        kind = SPAN_RECORD
    except ValueError:  # a value marshal refuses: write the header as JSON
        header = json.dumps(fields, default=_jsonable).encode()
        kind = JSON_SPAN_RECORD
    return b"".join((kind, _U32.pack(len(header)), header, *parts))


def decode_span(payload: bytes) -> StoredSpan:
    """The span a record payload holds; raises :class:`UnknownRecord` for anything else."""
    kind = payload[:1]
    try:
        (size,) = _U32.unpack_from(payload, 1)
        end = 5 + size
        if kind == SPAN_RECORD:
            fields = _marshal_loads(payload[5:end])
        elif kind == JSON_SPAN_RECORD:
            fields = json.loads(payload[5:end].decode("utf-8", "surrogatepass"))
        else:
            raise UnknownRecord(f"unknown record kind {kind!r}")
        if type(fields) is not tuple and type(fields) is not list:
            raise ValueError("the header is not a list")
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
            kind_value,
            flags,
            texts,
        ) = fields[:16]
        service_name = fields[16] if len(fields) > 16 else None
        for key, length in texts:
            attributes[key] = payload[end : end + length].decode("utf-8", "surrogatepass")
            end += length
        if end > len(payload):
            raise ValueError("the record's text part is cut short")
    except (ValueError, TypeError, EOFError, struct.error) as exc:
        raise UnknownRecord(f"unreadable span record: {exc}") from None
    status = _STATUS.get(status_code, _STATUS[0])
    if status_description is not None:
        status = StoredStatus(status.status_code, status_description)
    return _new_span(
        (
            name,
            _new_context((trace_id, span_id, False)),
            _new_context((trace_id, parent_id, False)) if parent_id is not None else None,
            start_time,
            end_time,
            _new_scope((scope_name, scope_version)) if scope_name is not None else None,
            status,
            attributes,
            [StoredEvent(e[0], e[1], e[2]) for e in events] if events else (),
            [StoredLink(_new_context((link[0], link[1], False)), link[2]) for link in links]
            if links
            else (),
            _KINDS.get(kind_value, SpanKind.INTERNAL),
            bool(flags & OWN_EVENT_QUEUED) if type(flags) is int else False,
            _resource_attributes(service_name),
        )
    )


_RESOURCES: dict[str | None, Mapping[str, Any]] = {}


def _resource_attributes(service_name: object) -> Mapping[str, Any]:
    """The (shared) resource attributes of a read-back span: its service name."""
    name = service_name if isinstance(service_name, str) else None
    found = _RESOURCES.get(name)
    if found is None:
        if len(_RESOURCES) >= 64:
            _RESOURCES.clear()
        found = _RESOURCES[name] = MappingProxyType({} if name is None else {"service.name": name})
    return found
