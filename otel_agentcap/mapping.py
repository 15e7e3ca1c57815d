"""Pure mapping from finished spans to event-log records (no I/O).

A span stamped by agentcap holds one event (its start) and, as span events named ``agentcap.*``,
any further events of the same operation (``tool_result``, ``agent_end``, ``agent_error``).
Spans without stamps are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.model import AgentRecord, Batch, Event, EventType, RunRecord


class _SpanContextLike(Protocol):
    @property
    def trace_id(self) -> int: ...

    @property
    def span_id(self) -> int: ...


class _SpanEventLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def attributes(self) -> Mapping[str, AttributeValue] | None: ...

    @property
    def timestamp(self) -> int: ...


class SpanLike(Protocol):
    """What the mapping reads of an SDK ``ReadableSpan``."""

    @property
    def name(self) -> str: ...

    @property
    def attributes(self) -> Mapping[str, AttributeValue] | None: ...

    @property
    def events(self) -> Sequence[_SpanEventLike]: ...

    @property
    def start_time(self) -> int | None: ...

    @property
    def end_time(self) -> int | None: ...

    @property
    def context(self) -> _SpanContextLike | None: ...


def _time(ns: int | None) -> datetime:
    return datetime.fromtimestamp((ns or 0) / 1e9, tz=UTC)


def _model_call_payload(span: SpanLike, attributes: Mapping[str, AttributeValue]) -> dict[str, Any]:
    """A model-call span's GenAI attributes as the event payload (content only where present,
    which is only when the user opted in to content capture)."""
    payload: dict[str, Any] = {"span_name": span.name}
    for key, value in attributes.items():
        if key.startswith(("gen_ai.", "anthropic.")) or key in (
            attr.ERROR_TYPE,
            "http.response.status_code",
        ):
            payload[key] = list(value) if isinstance(value, tuple) else value
    if span.start_time is not None and span.end_time is not None:
        payload["latency_ms"] = round((span.end_time - span.start_time) / 1e6, 3)
    return payload


def _event(
    attributes: Mapping[str, AttributeValue],
    timestamp: int | None,
    trace_id: str | None,
    span_id: str | None,
    payload: Any,
) -> Event | None:
    event_id = attributes.get(attr.EVENT_ID)
    if not isinstance(event_id, str):
        return None
    parents = attributes.get(attr.EVENT_CAUSAL_PARENT_IDS) or ()
    return Event(
        event_id=event_id,
        run_id=str(attributes.get(attr.RUN_ID, "")),
        agent_id=str(attributes.get(attr.AGENT_ID, "")),
        seq=int(attributes.get(attr.EVENT_SEQ, 0)),  # type: ignore[arg-type]
        event_type=str(attributes.get(attr.EVENT_TYPE, "")),
        idempotency_key=str(attributes.get(attr.EVENT_IDEMPOTENCY_KEY, "")),
        wall_time=_time(timestamp),
        causal_parent_ids=tuple(str(p) for p in parents),  # type: ignore[union-attr]
        payload=payload,
        trace_id=trace_id,
        span_id=span_id,
    )


def events_from_span(span: SpanLike) -> list[Event]:
    attributes = span.attributes or {}
    if attr.EVENT_ID not in attributes:
        return []
    ctx = span.context
    trace_id = f"{ctx.trace_id:032x}" if ctx is not None else None
    span_id = f"{ctx.span_id:016x}" if ctx is not None else None
    if attr.EVENT_PAYLOAD in attributes:
        payload = jsonsafe.loads(str(attributes[attr.EVENT_PAYLOAD]))
    elif attributes.get(attr.EVENT_TYPE) == EventType.MODEL_CALL:
        payload = _model_call_payload(span, attributes)
    else:
        payload = None
    events: list[Event] = []
    main = _event(attributes, span.start_time, trace_id, span_id, payload)
    if main is not None:
        events.append(main)
    for span_event in span.events:
        if not span_event.name.startswith(attr.SPAN_EVENT_PREFIX):
            continue
        event_attributes = span_event.attributes or {}
        raw = event_attributes.get(attr.EVENT_PAYLOAD)
        extra = _event(
            event_attributes,
            span_event.timestamp,
            trace_id,
            span_id,
            jsonsafe.loads(str(raw)) if raw is not None else None,
        )
        if extra is not None:
            events.append(extra)
    return events


def agents_from_span(span: SpanLike) -> list[AgentRecord]:
    attributes = span.attributes or {}
    if attr.EVENT_ID not in attributes:
        return []
    run_id = str(attributes.get(attr.RUN_ID, ""))
    agent_id = str(attributes.get(attr.AGENT_ID, ""))
    name = attributes.get(attr.AGENT_NAME)
    parent = attributes.get(attr.PARENT_AGENT_ID)
    spawned_at = attributes.get(attr.SPAWNED_AT_EVENT_ID)
    records = [
        AgentRecord(
            run_id,
            agent_id,
            name=str(name) if name is not None else None,
            parent_agent_id=str(parent) if parent is not None else None,
            spawned_at_event_id=str(spawned_at) if spawned_at is not None else None,
        )
    ]
    child = attributes.get(attr.CHILD_AGENT_ID)
    if attributes.get(attr.EVENT_TYPE) == EventType.AGENT_SPAWN and child is not None:
        child_name = attributes.get(attr.CHILD_AGENT_NAME)
        records.append(
            AgentRecord(
                run_id,
                str(child),
                name=str(child_name) if child_name is not None else None,
                parent_agent_id=agent_id,
                spawned_at_event_id=str(attributes[attr.EVENT_ID]),
            )
        )
    return records


def batch_from_spans(spans: Iterable[SpanLike]) -> Batch:
    """All events, agents and runs recorded by ``spans``; unstamped spans are skipped."""
    events: list[Event] = []
    agents: list[AgentRecord] = []
    for span in spans:
        events.extend(events_from_span(span))
        agents.extend(agents_from_span(span))
    started: dict[str, datetime] = {}
    for event in events:
        first = started.get(event.run_id)
        if first is None or event.wall_time < first:
            started[event.run_id] = event.wall_time
    runs = tuple(RunRecord(run_id, at) for run_id, at in started.items())
    return Batch(tuple(events), tuple(agents), runs)
