"""Pure mapping from finished spans to event-log records (no I/O).

A span stamped by agentcap holds one event (its start) and, in the ``agentcap.outcome`` attribute,
the closing event of the same operation (``tool_result``, ``agent_end``, ``agent_error``); span
events named ``agentcap.*`` holding such a record (what earlier versions wrote) are read too.
Spans without stamps are ignored.

One model call is one event (:mod:`otel_agentcap.pipeline.call_identity`): of two ``model_call``
events of a batch that record the same API call under different event ids, the one from the
anthropic SDK's own span is kept, else the first; the other goes to ``Batch.superseded``, which
storage keeps as a conflict.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.forks import renew_locks_after_fork
from otel_agentcap.model import (
    AgentRecord,
    Batch,
    Event,
    EventType,
    RunRecord,
    SpanRecord,
    from_fields,
)
from otel_agentcap.pipeline.call_identity import SUPERSEDED, CallIndex, call_ids, replaces
from otel_agentcap.pipeline.model_calls import is_sdk_scope, model_call_payload
from otel_agentcap.pipeline.span_attributes import attributes_of, has_events

# Defined in otel_agentcap.protocols, with the package's other interfaces.
from otel_agentcap.protocols import SpanCheck as SpanCheck
from otel_agentcap.protocols import SpanLike as SpanLike

_MODEL_CALL: Final = EventType.MODEL_CALL.value


def _time(ns: int | None) -> datetime:
    return datetime.fromtimestamp((ns or 0) / 1e9, tz=UTC)


#: An event's ``wall_time`` from a span time in nanoseconds, exactly as the mapping computes it
#: (a row written outside the mapping must equal the mapping's copy of it).
wall_time = _time


#: Hex trace ids by trace id, across batches: the spans of a run mostly share one trace.
#: Bounded; cleared when full.
_trace_hex: dict[int, str] = {}
_TRACE_HEX_MAX = 1024


def _trace_id_hex(trace_id: int) -> str:
    text = _trace_hex.get(trace_id)
    if text is None:
        if len(_trace_hex) >= _TRACE_HEX_MAX:
            _trace_hex.clear()
        text = _trace_hex[trace_id] = f"{trace_id:032x}"
    return text


def _scope_name(span: SpanLike) -> str | None:
    name = getattr(getattr(span, "instrumentation_scope", None), "name", None)
    return name if isinstance(name, str) else None


def _model_call_payload(span: SpanLike, attributes: Mapping[str, AttributeValue]) -> dict[str, Any]:
    """A model-call span as the event payload (see :mod:`otel_agentcap.pipeline.model_calls` for
    the keys; content only where present, which is only when the user opted in to content
    capture)."""
    return model_call_payload(
        span.name,
        attributes,
        start_time=span.start_time,
        end_time=span.end_time,
        status=getattr(span, "status", None),
        scope=_scope_name(span),
    )


class SpanRejected(ValueError):
    """A stamped span whose agentcap attributes cannot be read as records (a sequence that is
    not an integer, an id that is not a string, ...): the whole span is rejected, alone."""


def _text(value: object, name: str) -> str:
    """``value`` as a plain ``str`` (the capture sets some as ``str`` enums); raises
    ``SpanRejected`` when it is not a string."""
    if type(value) is str:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    raise SpanRejected(f"{name} is missing" if value is None else f"{name} is not a string")


def _event(
    attributes: Mapping[str, AttributeValue],
    timestamp: int | None,
    trace_id: str | None,
    span_id: str | None,
    payload: Any,
) -> Event:
    """The primary event of a span, from its stamp attributes (values as the capture sets them:
    strings, an int sequence, a tuple of parent ids); raises ``SpanRejected`` for values of
    another type. Storage validates the values (``otel_agentcap.validation``)."""
    get = attributes.get
    event_id = get(attr.EVENT_ID)
    if type(event_id) is not str:
        raise SpanRejected(f"{attr.EVENT_ID} is not a string")
    parents = get(attr.EVENT_CAUSAL_PARENT_IDS) or ()
    if type(parents) is not tuple:
        if not isinstance(parents, (list, tuple)):
            raise SpanRejected(f"{attr.EVENT_CAUSAL_PARENT_IDS} is not an array of strings")
        parents = tuple(parents)
    seq = get(attr.EVENT_SEQ)
    if type(seq) is not int:
        raise SpanRejected(
            f"{attr.EVENT_SEQ} is missing" if seq is None else f"{attr.EVENT_SEQ} is not an integer"
        )
    key = get(attr.EVENT_IDEMPOTENCY_KEY)
    run_id = get(attr.RUN_ID)
    agent_id = get(attr.AGENT_ID)
    event_type = get(attr.EVENT_TYPE)
    if type(run_id) is not str or type(agent_id) is not str or type(event_type) is not str:
        run_id = _text(run_id, attr.RUN_ID)
        agent_id = _text(agent_id, attr.AGENT_ID)
        event_type = _text(event_type, attr.EVENT_TYPE)
    return _new_event(
        (
            event_id,
            run_id,
            agent_id,
            seq,
            event_type,
            # The key is left out of the span when it is the default.
            f"seq:{seq}" if key is None else _text(key, attr.EVENT_IDEMPOTENCY_KEY),
            _time(timestamp),
            parents,
            payload,
            trace_id,
            span_id,
        )
    )


_new_event = from_fields(Event)


_PAYLOAD_SEPARATOR = ',"payload":'


def _salvage_record(raw: str) -> dict[str, Any] | None:
    """Recover a span-event record whose text was cut (e.g. by an attribute length limit): the
    header before the payload is complete, and the payload is kept as ``$agentcap.unparsed``.
    The separator cannot occur inside the header's JSON strings, whose quotes are escaped."""
    index = raw.find(_PAYLOAD_SEPARATOR)
    if index < 0:
        return None
    header = jsonsafe.loads(raw[:index] + "}")
    if not isinstance(header, dict) or not isinstance(header.get("id"), str):
        return None
    header["payload"] = jsonsafe.loads(raw[index + len(_PAYLOAD_SEPARATOR) :])
    return header


def _record_event(
    raw: AttributeValue | None,
    owner: Mapping[str, AttributeValue],
    timestamp: int | None,
    trace_id: str | None,
    span_id: str | None,
) -> Event | None:
    """A further event of a span, recorded as one JSON record; run and agent are the span's.
    None when the record cannot be read back (cut before its identity); raises ``SpanRejected``
    when it can be read but its fields have the wrong types."""
    if not isinstance(raw, str):
        return None
    record = jsonsafe.loads(raw)
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        record = _salvage_record(raw)
        if record is None:
            return None
    seq = record.get("seq")
    if type(seq) is not int:
        raise SpanRejected("the sequence of a closing event is not an integer")
    parents = record.get("parents") or ()
    if not isinstance(parents, list | tuple) or not all(type(p) is str for p in parents):
        raise SpanRejected("the causal parents of a closing event are not strings")
    return Event(
        event_id=record["id"],
        run_id=_text(owner.get(attr.RUN_ID), attr.RUN_ID),
        agent_id=_text(owner.get(attr.AGENT_ID), attr.AGENT_ID),
        seq=seq,
        event_type=_text(record.get("type"), "the type of a closing event"),
        idempotency_key=_text(record.get("key"), "the key of a closing event"),
        wall_time=_time(timestamp),
        causal_parent_ids=tuple(parents),
        payload=record.get("payload"),
        trace_id=trace_id,
        span_id=span_id,
    )


def events_from_span(span: SpanLike, *, raw_payloads: bool = False) -> list[Event]:
    """The events a span records. With ``raw_payloads`` a valid payload stays JSON text
    (``jsonsafe.RawJson``), which storage writes as is; otherwise payloads are parsed."""
    return _events(span, attributes_of(span), raw_payloads)


_logger = logging.getLogger(__name__)
_unreadable_lock = threading.Lock()
renew_locks_after_fork(sys.modules[__name__], "_unreadable_lock")
_unreadable_logged_at = 0.0


def _unreadable(span: SpanLike, raw: AttributeValue) -> None:
    """Log (at most once a minute) a closing event that cannot be read back."""
    global _unreadable_logged_at
    now = time.monotonic()
    with _unreadable_lock:
        if now - _unreadable_logged_at < 60:
            return
        _unreadable_logged_at = now
    _logger.warning(
        "agentcap: the closing event of span %r cannot be read (%d characters of %s survive; an "
        "attribute value length limit such as OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT cuts it); it is "
        "lost and counted",
        getattr(span, "name", "?"),
        len(raw) if isinstance(raw, str) else 0,
        attr.OUTCOME,
    )


def _events(
    span: SpanLike,
    attributes: Mapping[str, AttributeValue],
    raw_payloads: bool,
    lost: list[int] | None = None,
) -> list[Event]:
    if attr.EVENT_ID not in attributes or attributes.get(SUPERSEDED):
        # A superseded span is a second record of a model call that another span holds.
        return []
    ctx = span.context
    trace_id = _trace_id_hex(ctx.trace_id) if ctx is not None else None
    span_id = f"{ctx.span_id:016x}" if ctx is not None else None
    text = attributes.get(attr.EVENT_PAYLOAD)
    if text is not None:
        text = str(text)
        payload = jsonsafe.raw_or_loads(text) if raw_payloads else jsonsafe.loads(text)
    elif attributes.get(attr.EVENT_TYPE) == _MODEL_CALL:
        payload = _model_call_payload(span, attributes)
    else:
        payload = None
    events: list[Event] = [_event(attributes, span.start_time, trace_id, span_id, payload)]
    outcome = attributes.get(attr.OUTCOME)
    if outcome is not None:
        closing = _record_event(outcome, attributes, span.end_time, trace_id, span_id)
        if closing is not None:
            events.append(closing)
        else:
            _unreadable(span, outcome)
            if lost is not None:
                lost[0] += 1
    # Span events (how earlier versions recorded closing events): read only when the span has
    # some, as the SDK's ``events`` property copies them.
    for span_event in span.events if has_events(span) else ():
        if span_event.name.startswith(attr.SPAN_EVENT_PREFIX):
            raw = (span_event.attributes or {}).get(attr.SPAN_EVENT_RECORD)
            extra = _record_event(raw, attributes, span_event.timestamp, trace_id, span_id)
            if extra is not None:
                events.append(extra)
    return events


def agents_from_span(span: SpanLike) -> list[AgentRecord]:
    """The agent rows a span implies (its own agent, and a spawned child)."""
    return _agents(attributes_of(span))


def _optional_text(value: object, name: str) -> str | None:
    return None if value is None else _text(value, name)


def _agents(attributes: Mapping[str, AttributeValue]) -> list[AgentRecord]:
    """The agent rows of a stamped span. Only the agent's own ``agent_start`` knows its lineage
    (a parent and spawn link, or none: a root), and its parent's ``agent_spawn``; other spans
    leave it unknown, whatever they carry."""
    if attr.EVENT_ID not in attributes:
        return []
    run_id = _text(attributes.get(attr.RUN_ID), attr.RUN_ID)
    agent_id = _text(attributes.get(attr.AGENT_ID), attr.AGENT_ID)
    name = _optional_text(attributes.get(attr.GEN_AI_AGENT_NAME), attr.GEN_AI_AGENT_NAME)
    event_type = attributes.get(attr.EVENT_TYPE)
    starts = event_type == EventType.AGENT_START
    records = [
        AgentRecord(
            run_id,
            agent_id,
            name=name,
            parent_agent_id=_optional_text(
                attributes.get(attr.PARENT_AGENT_ID), attr.PARENT_AGENT_ID
            )
            if starts
            else None,
            spawned_at_event_id=_optional_text(
                attributes.get(attr.SPAWNED_AT_EVENT_ID), attr.SPAWNED_AT_EVENT_ID
            )
            if starts
            else None,
            lineage_known=starts,
        )
    ]
    child = attributes.get(attr.CHILD_AGENT_ID)
    if event_type == EventType.AGENT_SPAWN and child is not None:
        records.append(
            AgentRecord(
                run_id,
                _text(child, attr.CHILD_AGENT_ID),
                name=_optional_text(attributes.get(attr.CHILD_AGENT_NAME), attr.CHILD_AGENT_NAME),
                parent_agent_id=agent_id,
                spawned_at_event_id=_text(attributes[attr.EVENT_ID], attr.EVENT_ID),
                lineage_known=True,
            )
        )
    return records


_AGENT_KEYS = (
    attr.EVENT_TYPE,
    attr.RUN_ID,
    attr.AGENT_ID,
    attr.GEN_AI_AGENT_NAME,
    attr.PARENT_AGENT_ID,
    attr.SPAWNED_AT_EVENT_ID,
    attr.CHILD_AGENT_ID,
    attr.CHILD_AGENT_NAME,
)


#: Agent records by span identity (``_AGENT_KEYS``), across batches: most batches name agents an
#: earlier batch named already. Bounded; cleared when full.
_agent_records: dict[tuple[object, ...], tuple[AgentRecord, ...]] = {}
_AGENT_RECORDS_MAX = 4096


def _remember_agents(
    identity: tuple[object, ...], attributes: Mapping[str, AttributeValue]
) -> tuple[AgentRecord, ...]:
    records = tuple(_agents(attributes))
    if len(_agent_records) >= _AGENT_RECORDS_MAX:
        _agent_records.clear()
    _agent_records[identity] = records
    return records


class _ModelCalls:
    """The model calls of one batch: keeps one event per call in ``events`` and moves the others
    to ``superseded`` (:mod:`otel_agentcap.pipeline.call_identity`)."""

    __slots__ = ("calls", "events", "sdk", "superseded")

    def __init__(self, events: list[Event]) -> None:
        self.events = events
        #: Each set-aside record with the index in ``events`` of the record kept for its call.
        self.superseded: list[tuple[Event, int]] = []
        self.calls: CallIndex[int] = CallIndex()
        self.sdk: set[int] = set()

    def set_aside(self) -> tuple[tuple[Event, ...], tuple[str, ...]]:
        """The set-aside records and, for each, the event id of the record finally kept."""
        if not self.superseded:
            return (), ()
        return (
            tuple(event for event, _ in self.superseded),
            tuple(self.events[index].event_id for _, index in self.superseded),
        )

    def add(self, event: Event, sdk: bool) -> None:
        run_id = event.run_id
        response_id, request_id = call_ids(event.payload)
        events = self.events
        by_response, by_request = self.calls.matches(run_id, response_id, request_id)
        matched = by_response if by_response is not None else by_request
        if matched is None:
            index = len(events)
            events.append(event)
        else:
            index = matched
            if replaces(sdk, index in self.sdk) and (
                by_response is None or by_request is None or by_response == by_request
            ):
                # Takes the place of the kept record. Not when its ids name two kept events:
                # it would then share an id with the other one.
                self.superseded.append((events[index], index))
                events[index] = event
            else:
                self.superseded.append((event, index))
        if sdk and events[index] is event:
            self.sdk.add(index)
        self.calls.add(run_id, response_id, request_id, index)


def _enum_value(value: Any, default: int) -> int:
    number = getattr(value, "value", value)
    return number if type(number) is int else default


#: service.name by resource object (the spans of a process share one resource). Bounded.
_services: dict[int, tuple[object, str | None]] = {}


def _service_name(span: SpanLike) -> str | None:
    resource = getattr(span, "resource", None)
    if resource is not None:
        cached = _services.get(id(resource))
        if cached is not None and cached[0] is resource:
            return cached[1]
        attributes = getattr(resource, "attributes", None)
    else:
        attributes = getattr(span, "resource_attributes", None)  # an OTLP-decoded span
    value = attributes.get("service.name") if attributes else None
    name = value if isinstance(value, str) else None
    if resource is not None:
        if len(_services) >= 64:
            _services.clear()
        _services[id(resource)] = (resource, name)
    return name


#: A span's kind, status code, status message and scope name, as its envelope stores them.
_Shape = tuple[int, int, str | None, str | None]
#: Shapes by the kind, status and instrumentation scope objects they come from, which spans
#: share (the SDK's default status is one object, a tracer's scope another). Bounded.
_shapes: dict[tuple[int, int, int], tuple[object, object, object, _Shape]] = {}


def _shape(span: SpanLike) -> _Shape:
    """(kind, status code, status message, scope name) of ``span``, as its envelope stores them."""
    kind = getattr(span, "kind", None)
    status = getattr(span, "status", None)
    scope = getattr(span, "instrumentation_scope", None)
    key = (id(kind), id(status), id(scope))
    cached = _shapes.get(key)
    if cached is not None and cached[0] is kind and cached[1] is status and cached[2] is scope:
        return cached[3]
    code = getattr(status, "status_code", None)
    message = getattr(status, "description", None)
    shape = (
        _enum_value(kind, 0),
        _enum_value(code, 0) if code is not None else 0,
        message if isinstance(message, str) and message else None,
        _scope_name(span) or None,
    )
    if len(_shapes) >= 256:
        _shapes.clear()
    _shapes[key] = (kind, status, scope, shape)
    return shape


def span_record(
    span: SpanLike,
    run_id: str,
    start: datetime | None = None,
    end: datetime | None = None,
    ids: tuple[str | None, str | None] | None = None,
) -> SpanRecord | None:
    """The envelope of a span that carries events of ``run_id`` (or is its root span); ``start``
    and ``end`` are its times as datetimes, and ``ids`` its hex trace and span ids, when the
    caller has them already."""
    ctx = span.context
    if ctx is None:
        return None
    parent = getattr(span, "parent", None)
    parent_id = parent.span_id if parent is not None else 0
    trace_id, span_id = ids if ids is not None else (None, None)
    kind, code, message, scope = _shape(span)
    return _new_span_record(
        (
            run_id,
            trace_id if trace_id is not None else _trace_id_hex(ctx.trace_id),
            span_id if span_id is not None else f"{ctx.span_id:016x}",
            f"{parent_id:016x}" if parent_id else None,
            span.name,
            kind,
            start if start is not None else _time(span.start_time),
            end if end is not None else _time(span.end_time or span.start_time),
            code,
            message,
            _service_name(span),
            scope,
        )
    )


_new_span_record = from_fields(SpanRecord)


def declared_run_attributes(attributes: Mapping[str, AttributeValue]) -> dict[str, Any] | None:
    """The attributes ``run(run_id, **attributes)`` declared, from a span that carries them
    (the spans of the run's agent executions); None when the span declares none. A value that
    is not a JSON object (not JSON, cut by a length limit say, or JSON of another kind) is kept
    whole as ``{"$agentcap.unparsed": text}``, as an import of a file keeps it."""
    return _declared(attributes)[0]


def _declared(
    attributes: Mapping[str, AttributeValue],
) -> tuple[jsonsafe.EncodedObject | None, bool]:
    """``declared_run_attributes``, and whether the value was kept in a marker."""
    declared = attributes.get(attr.RUN_ATTRIBUTES)
    if not isinstance(declared, str):
        return None, False
    # Encoded already (by capture): stored as it is, not encoded again.
    try:
        parsed = json.loads(declared)
    except (ValueError, RecursionError):
        return jsonsafe.EncodedObject(jsonsafe.loads(declared)), True  # its marker
    if not isinstance(parsed, dict):
        return jsonsafe.EncodedObject({"$agentcap.unparsed": declared}), True
    return jsonsafe.EncodedObject(parsed), False


def _span_agents(attributes: Mapping[str, AttributeValue]) -> tuple[AgentRecord, ...]:
    """The agent records of a span; most spans name the same agent again, so records are kept
    by the attributes they come from (a spawn's records also hold its event id: built anew)."""
    identity = tuple(map(attributes.get, _AGENT_KEYS))
    if identity[0] == EventType.AGENT_SPAWN:
        return tuple(_agents(attributes))
    try:
        records = _agent_records.get(identity)
    except TypeError:  # an unhashable value (an OTLP key-value list): nothing to cache
        return tuple(_agents(attributes))
    return records if records is not None else _remember_agents(identity, attributes)


def _root_span(
    span: SpanLike,
    attributes: Mapping[str, AttributeValue],
    check: SpanCheck | None,
    started: dict[str, datetime],
    roots: dict[str, tuple[str, str]],
    envelopes: list[SpanRecord],
    declarations: dict[str, list[dict[str, Any]]],
    unparsed: dict[str, None],
    recorded: dict[str, datetime],
) -> str | None:
    """Take a run's root span (``ac.run``: no event of its own): its envelope, the run's root
    span ids and start (the start an export recorded on it, if any), and the attributes it
    declares; or why it is rejected."""
    try:
        run_id = _text(attributes.get(attr.RUN_ID), attr.RUN_ID)
        recorded_start = attributes.get(attr.RUN_STARTED_AT)
        if recorded_start is not None and (
            type(recorded_start) is not int or not 0 <= recorded_start < 2**63
        ):
            raise SpanRejected(f"{attr.RUN_STARTED_AT} is not Unix nanoseconds")
        declared, wrapped = (
            _declared(attributes) if attr.RUN_ATTRIBUTES in attributes else (None, False)
        )
        reason = None if check is None else check(span, (), (), declared, run_id)
        envelope = span_record(span, run_id) if reason is None else None
    except SpanRejected as exc:
        return str(exc)
    except Exception as exc:  # a value no capture sets, that the mapping could not handle
        return f"span could not be read: {type(exc).__name__}: {exc}"
    if reason is not None or envelope is None:
        return reason
    envelopes.append(envelope)
    roots[run_id] = (envelope.trace_id, envelope.span_id)
    first = started.get(run_id)
    if first is None or envelope.start_time < first:
        started[run_id] = envelope.start_time
    if type(recorded_start) is int:
        recorded.setdefault(run_id, _time(recorded_start))
    if declared is not None:
        runs_declared = declarations.setdefault(run_id, [])
        if declared not in runs_declared:
            runs_declared.append(declared)
        if wrapped:
            unparsed[run_id] = None
    return None


def batch_from_spans(
    spans: Iterable[SpanLike], *, raw_payloads: bool = False, check: SpanCheck | None = None
) -> Batch:
    """All events, agents and runs recorded by ``spans``; unstamped spans are skipped.
    Agent rows that repeat one another exactly are given once; a model call recorded by several
    spans under different event ids is one event (the others in ``Batch.superseded``).

    A span whose agentcap attributes cannot be read as records, or that ``check`` refuses, is
    left out whole and listed in ``Batch.rejected`` with its position and the reason; the other
    spans are mapped as if it were not there. Of several different attribute declarations of
    one run, the first comes first in ``Batch.runs``."""
    events: list[Event] = []
    calls = _ModelCalls(events)
    agents: dict[AgentRecord, None] = {}
    started: dict[str, datetime] = {}
    declarations: dict[str, list[dict[str, Any]]] = {}
    roots: dict[str, tuple[str, str]] = {}
    recorded: dict[str, datetime] = {}
    envelopes: list[SpanRecord] = []
    rejected: list[tuple[int, str]] = []
    unparsed: dict[str, None] = {}
    lost = [0]
    for index, span in enumerate(spans):
        attributes = attributes_of(span)  # read only, never copied: the spans have ended
        if attr.EVENT_ID not in attributes:
            if attributes.get(attr.RUN_ROOT) is True:
                reason = _root_span(
                    span,
                    attributes,
                    check,
                    started,
                    roots,
                    envelopes,
                    declarations,
                    unparsed,
                    recorded,
                )
                if reason is not None:
                    rejected.append((index, reason))
            continue
        try:
            span_events = _events(span, attributes, raw_payloads, lost)
            records = _span_agents(attributes)
            declared, wrapped = (
                _declared(attributes) if attr.RUN_ATTRIBUTES in attributes else (None, False)
            )
            reason = None if check is None else check(span, span_events, records, declared, None)
        except SpanRejected as exc:
            reason = str(exc)
        except Exception as exc:  # a value no capture sets, that the mapping could not handle
            reason = f"span could not be read: {type(exc).__name__}: {exc}"
        if reason is not None:
            rejected.append((index, reason))
            continue
        for event in span_events:
            if event.event_type == _MODEL_CALL:
                calls.add(event, is_sdk_scope(_scope_name(span)))
            else:
                events.append(event)
            # The run started no later than its earliest event (kept or set aside).
            first = started.get(event.run_id)
            if first is None or event.wall_time < first:
                started[event.run_id] = event.wall_time
        if span_events:
            # The first event is the span's own (its time is the span's start); a closing
            # record's time is the span's end.
            primary = span_events[0]
            closing = (
                span_events[1].wall_time
                if len(span_events) > 1 and attr.OUTCOME in attributes
                else None
            )
            envelope = span_record(
                span,
                primary.run_id,
                primary.wall_time,
                closing,
                (primary.trace_id, primary.span_id),
            )
            if envelope is not None:
                envelopes.append(envelope)
        elif attributes.get(attr.RUN_ROOT) is True:
            run_id = attributes.get(attr.RUN_ID)
            envelope = span_record(span, run_id) if type(run_id) is str else None
            if envelope is not None and type(run_id) is str:
                envelopes.append(envelope)
                roots[run_id] = (envelope.trace_id, envelope.span_id)
                first = started.get(run_id)
                if first is None or envelope.start_time < first:
                    started[run_id] = envelope.start_time
        for record in records:
            agents[record] = None
        if declared is not None:
            declaring = str(attributes[attr.RUN_ID])
            runs_declared = declarations.setdefault(declaring, [])
            if declared not in runs_declared:
                runs_declared.append(declared)
            if wrapped:
                unparsed[declaring] = None
    superseded, kept = calls.set_aside()
    runs: list[RunRecord] = []
    for run_id, at in started.items():
        trace_id, root_span_id = roots.get(run_id, (None, None))
        declared_list = declarations.get(run_id)
        exact = run_id in recorded
        at = recorded.get(run_id, at)
        if not declared_list:
            runs.append(RunRecord(run_id, at, None, trace_id, root_span_id, exact))
        else:
            runs.extend(
                RunRecord(run_id, at, declared, trace_id, root_span_id, exact)
                for declared in declared_list
            )
    return Batch(
        tuple(events),
        tuple(agents),
        tuple(runs),
        superseded,
        kept,
        lost[0],
        tuple(envelopes),
        tuple(rejected),
        tuple(unparsed),
    )


# What ``exporters.postgres.one_pass`` builds its rows with, so that they equal the mapping's.
#: A closing event from its JSON record (see ``_record_event``).
record_event = _record_event
#: The agent records of a stamped span (see ``_span_agents``).
span_agents = _span_agents
#: (kind, status code, status message, scope name) of a span's envelope.
span_shape = _shape
#: The ``service.name`` of a span's resource.
span_service_name = _service_name
#: A trace id as 32 hex digits (cached).
trace_id_hex = _trace_id_hex
