"""The trace of a run, rebuilt from the log: one span per captured operation, with the parent,
name, kind, times, status and service it was recorded with (``agentcap.spans``), the stamp
attributes and closing record the capture put on it (from the events, so that mapping the spans
again gives the same events, agents and run), and a link per causal parent to the span that
carries the parent event (at most ``attributes.MAX_CAUSAL_LINKS`` per span, as at capture).

The run's root span is rebuilt from its envelope, or, when that never reached the log (the process
that opened the run stopped before its root span ended), from the run row: started when the run
started, ended with the run's last span. Events without a span id (hand-built batches) have no
place in a trace and are left out (counted in :attr:`RunTrace.events_without_span`), and so are
events whose trace and span ids are not the hex ids of a trace (hand-built batches may store any
text); a run root and span parents with such ids are left out too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from otel_agentcap import attributes as attr
from otel_agentcap.capture.memory import MEMORY_KEY, MEMORY_NAME
from otel_agentcap.model import EventType
from otel_agentcap.transfer.snapshot import AgentRow, EventRow, RunSnapshot, SpanRow

INTERNAL = 0
CLIENT = 2
STATUS_ERROR = 2

Attribute = tuple[str, Any]


@dataclass(frozen=True, slots=True)
class TraceLink:
    trace_id: str
    span_id: str
    event_id: str


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """A span event (how earlier versions recorded closing events, beyond the two a span holds)."""

    name: str
    time_us: int
    attributes: tuple[Attribute, ...]


@dataclass(frozen=True, slots=True)
class TraceSpan:
    envelope: SpanRow
    attributes: tuple[Attribute, ...]
    links: tuple[TraceLink, ...] = ()
    events: tuple[TraceEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class RunTrace:
    run_id: str
    spans: tuple[TraceSpan, ...]
    events_without_span: int = 0
    trace_ids: tuple[str, ...] = field(default=())


def _payload(event: EventRow) -> Any:
    if event.payload_json is None:
        return None
    try:
        return json.loads(event.payload_json)
    except ValueError:
        return None


def _get(payload: Any, key: str) -> Any:
    return payload.get(key) if isinstance(payload, dict) else None


def _outcome(event: EventRow) -> str:
    """The closing event as the ``agentcap.outcome`` record the capture writes."""
    parents = json.dumps(list(event.causal_parent_ids), separators=(",", ":"))
    return (
        f'{{"id":{json.dumps(event.event_id)},"type":{json.dumps(event.event_type)},'
        f'"seq":{event.logical_seq},"key":{json.dumps(event.idempotency_key)},'
        f'"parents":{parents},'
        f'"payload":{event.payload_json if event.payload_json is not None else "null"}}}'
    )


def _synthesized(run_id: str, events: list[EventRow]) -> SpanRow:
    """An envelope for events whose span left none in the log (written by an earlier version)."""
    first = events[0]
    payload = _payload(first)
    kind = INTERNAL
    end = max(e.wall_time_us for e in events)
    if first.event_type == EventType.AGENT_START:
        name = f"invoke_agent {first.agent_id}"
    elif first.event_type == EventType.AGENT_SPAWN:
        name = f"create_agent {_get(payload, 'child_agent_id') or first.agent_id}"
    elif first.event_type == EventType.TOOL_INVOCATION:
        name = f"execute_tool {_get(payload, 'tool') or ''}".strip()
    elif first.event_type == EventType.MODEL_CALL:
        name = str(_get(payload, "span_name") or "chat")
        kind = CLIENT
        latency = _get(payload, "latency_ms")
        if isinstance(latency, int | float):
            end = max(end, first.wall_time_us + round(latency * 1000))
    else:
        name = first.event_type
    failed = any(e.event_type == EventType.AGENT_ERROR for e in events) or (
        first.event_type == EventType.MODEL_CALL and _get(payload, "status") == "error"
    )
    assert first.trace_id is not None and first.span_id is not None
    return SpanRow(
        run_id,
        first.trace_id,
        first.span_id,
        None,
        name,
        kind,
        first.wall_time_us,
        end,
        STATUS_ERROR if failed else 0,
        None,
        None,
        None,
    )


class _Builder:
    def __init__(self, snapshot: RunSnapshot) -> None:
        self.snapshot = snapshot
        self.run_id = snapshot.run.run_id
        self.agents: dict[str, AgentRow] = {a.agent_id: a for a in snapshot.agents}
        self.children: dict[str, AgentRow] = {
            a.spawned_at_event_id: a for a in snapshot.agents if a.spawned_at_event_id
        }
        self.run_attributes = (
            snapshot.run.attributes_json if snapshot.run.attributes_json != "{}" else None
        )
        self.by_event: dict[str, EventRow] = {e.event_id: e for e in snapshot.events}
        # A parent id that names a record kept aside as a conflict resolves to the stored event.
        self.aside: dict[str, str] = {
            c.event.event_id: c.existing_event_id
            for c in snapshot.conflicts
            if c.existing_event_id is not None
        }
        self.agents_placed: set[str] = set()

    def parent_span(self, parent_id: str) -> tuple[str, str] | None:
        event = self.by_event.get(parent_id)
        if event is None and parent_id in self.aside:
            event = self.by_event.get(self.aside[parent_id])
        if event is None or event.trace_id is None or event.span_id is None:
            return None
        if not in_trace(event.trace_id, event.span_id):
            return None  # left out of the trace (see rebuild)
        return event.trace_id, event.span_id

    def links(self, envelope: SpanRow, events: list[EventRow]) -> tuple[TraceLink, ...]:
        links: list[TraceLink] = []
        seen: set[str] = set()
        for event in events:
            for parent_id in event.causal_parent_ids:
                if parent_id in seen or len(links) >= attr.MAX_CAUSAL_LINKS:
                    continue
                target = self.parent_span(parent_id)
                if target is None or target == (envelope.trace_id, envelope.span_id):
                    continue
                seen.add(parent_id)
                links.append(TraceLink(target[0], target[1], parent_id))
        return tuple(links)

    def agent_attributes(self, agent_id: str, with_origin: bool) -> list[Attribute]:
        agent = self.agents.get(agent_id)
        out: list[Attribute] = [
            (attr.RUN_ID, self.run_id),
            (attr.AGENT_ID, agent_id),
            (attr.GEN_AI_AGENT_ID, agent_id),
        ]
        if agent is not None and agent.name is not None:
            out.append((attr.GEN_AI_AGENT_NAME, agent.name))
        if with_origin and agent is not None:
            if agent.parent_agent_id is not None:
                out.append((attr.PARENT_AGENT_ID, agent.parent_agent_id))
            if agent.spawned_at_event_id is not None:
                out.append((attr.SPAWNED_AT_EVENT_ID, agent.spawned_at_event_id))
            self.agents_placed.add(agent_id)
        return out

    def span(self, envelope: SpanRow, events: list[EventRow]) -> TraceSpan:
        first = events[0]
        payload = _payload(first)
        out = self.agent_attributes(first.agent_id, first.event_type == EventType.AGENT_START)
        out += [
            (attr.EVENT_ID, first.event_id),
            (attr.EVENT_TYPE, first.event_type),
            (attr.EVENT_SEQ, first.logical_seq),
        ]
        if first.idempotency_key != f"seq:{first.logical_seq}":
            out.append((attr.EVENT_IDEMPOTENCY_KEY, first.idempotency_key))
        if first.causal_parent_ids:
            out.append((attr.EVENT_CAUSAL_PARENT_IDS, first.causal_parent_ids))
        if first.payload_json is not None:
            out.append((attr.EVENT_PAYLOAD, first.payload_json))
        out += self.genai(first, payload)
        if len(events) > 1:
            out.append((attr.OUTCOME, _outcome(events[1])))
        extra = tuple(
            TraceEvent(
                f"{attr.SPAN_EVENT_PREFIX}{e.event_type}",
                e.wall_time_us,
                ((attr.SPAN_EVENT_RECORD, _outcome(e)),),
            )
            for e in events[2:]
        )
        return TraceSpan(envelope, tuple(out), self.links(envelope, events), extra)

    def genai(self, event: EventRow, payload: Any) -> list[Attribute]:
        kind = event.event_type
        if kind == EventType.AGENT_START:
            out: list[Attribute] = [(attr.GEN_AI_OPERATION_NAME, attr.OP_INVOKE_AGENT)]
            if self.run_attributes is not None:
                out.append((attr.RUN_ATTRIBUTES, self.run_attributes))
            return out
        if kind == EventType.AGENT_SPAWN:
            out = [(attr.GEN_AI_OPERATION_NAME, attr.OP_CREATE_AGENT)]
            child = self.children.get(event.event_id)
            child_id = child.agent_id if child is not None else _get(payload, "child_agent_id")
            child_name = child.name if child is not None else _get(payload, "child_name")
            if isinstance(child_id, str):
                out.append((attr.CHILD_AGENT_ID, child_id))
            if isinstance(child_name, str):
                out.append((attr.CHILD_AGENT_NAME, child_name))
            return out
        if kind == EventType.TOOL_INVOCATION:
            out = [(attr.GEN_AI_OPERATION_NAME, attr.OP_EXECUTE_TOOL)]
            for key, name in (
                (attr.GEN_AI_TOOL_NAME, "tool"),
                (attr.GEN_AI_TOOL_CALL_ID, "invocation_id"),
            ):
                value = _get(payload, name)
                if isinstance(value, str):
                    out.append((key, value))
            return out
        if kind in (EventType.MEMORY_READ, EventType.MEMORY_WRITE):
            out = []
            for key, name in ((MEMORY_KEY, "key"), (MEMORY_NAME, "memory")):
                value = _get(payload, name)
                if isinstance(value, str):
                    out.append((key, value))
            return out
        if kind == EventType.MODEL_CALL:
            out = [(attr.GEN_AI_OPERATION_NAME, attr.OP_CHAT)]
            for key, name in (
                (attr.GEN_AI_PROVIDER_NAME, "provider"),
                (attr.GEN_AI_REQUEST_MODEL, "request_model"),
                (attr.GEN_AI_RESPONSE_MODEL, "response_model"),
                (attr.GEN_AI_RESPONSE_ID, "response_id"),
            ):
                value = _get(payload, name)
                if isinstance(value, str):
                    out.append((key, value))
            usage = _get(payload, "usage")
            for key, name in (
                (attr.GEN_AI_USAGE_INPUT_TOKENS, "input_tokens"),
                (attr.GEN_AI_USAGE_OUTPUT_TOKENS, "output_tokens"),
            ):
                value = _get(usage, name)
                if type(value) is int:
                    out.append((key, value))
            return out
        return []

    def root(self, envelope: SpanRow) -> TraceSpan:
        out: list[Attribute] = [
            (attr.GEN_AI_OPERATION_NAME, attr.OP_INVOKE_WORKFLOW),
            (attr.RUN_ID, self.run_id),
            (attr.RUN_ROOT, True),
        ]
        started = self.snapshot.run.started_at_us
        if started is not None and started != envelope.start_us:
            # The log's start (its root span stored last): an import would take the span's.
            out.append((attr.RUN_STARTED_AT, started * 1000))
        if self.run_attributes is not None:
            out.append((attr.RUN_ATTRIBUTES, self.run_attributes))
        return TraceSpan(envelope, tuple(out))


def _origin_attributes(span: TraceSpan, agent: AgentRow) -> TraceSpan:
    extra: list[Attribute] = []
    if agent.parent_agent_id is not None:
        extra.append((attr.PARENT_AGENT_ID, agent.parent_agent_id))
    if agent.spawned_at_event_id is not None:
        extra.append((attr.SPAWNED_AT_EVENT_ID, agent.spawned_at_event_id))
    return TraceSpan(span.envelope, span.attributes + tuple(extra), span.links, span.events)


_HEX: Final = frozenset("0123456789abcdef")


def hex_id(value: str | None, digits: int) -> bool:
    """Whether ``value`` is ``digits`` lower-case hex digits (32 for a trace id, 16 for a span
    id, as the mapping stores them)."""
    return value is not None and len(value) == digits and _HEX.issuperset(value)


def in_trace(trace_id: str | None, span_id: str | None) -> bool:
    """Whether ``trace_id`` and ``span_id`` are ids a trace can hold; a hand-built batch may
    store any text."""
    return hex_id(trace_id, 32) and hex_id(span_id, 16)


def rebuild(snapshot: RunSnapshot) -> RunTrace:
    """The trace of the run in ``snapshot``, spans ordered by (start, trace id, span id)."""
    builder = _Builder(snapshot)
    run = snapshot.run
    envelopes = {(s.trace_id, s.span_id): s for s in snapshot.spans}
    grouped: dict[tuple[str, str], list[EventRow]] = defaultdict(list)
    without_span = 0
    for event in snapshot.events:
        if (
            event.trace_id is None
            or event.span_id is None
            or not in_trace(event.trace_id, event.span_id)
        ):
            without_span += 1
            continue
        grouped[(event.trace_id, event.span_id)].append(event)
    spans: list[TraceSpan] = []
    first_span_of: dict[str, int] = {}
    for key in sorted(grouped, key=lambda k: (min(e.wall_time_us for e in grouped[k]), k)):
        events = sorted(grouped[key], key=lambda e: (e.logical_seq, e.event_id))
        envelope = envelopes.get(key) or _synthesized(run.run_id, events)
        parent = envelope.parent_span_id
        if parent is not None and not in_trace(envelope.trace_id, parent):
            envelope = replace(envelope, parent_span_id=None)
        first_span_of.setdefault(events[0].agent_id, len(spans))
        spans.append(builder.span(envelope, events))
    # An agent whose origin (parent, spawn) no agent_start span carried gets it on its first span.
    for agent in snapshot.agents:
        if agent.agent_id in builder.agents_placed or agent.agent_id not in first_span_of:
            continue
        if agent.parent_agent_id is None and agent.spawned_at_event_id is None:
            continue
        index = first_span_of[agent.agent_id]
        spans[index] = _origin_attributes(spans[index], agent)
    if (
        run.trace_id is not None
        and run.root_span_id is not None
        and in_trace(run.trace_id, run.root_span_id)
    ):
        root = envelopes.get((run.trace_id, run.root_span_id))
        if root is None:
            ends = [s.envelope.end_us for s in spans]
            start = (
                run.started_at_us
                if run.started_at_us is not None
                else min((s.envelope.start_us for s in spans), default=0)
            )
            root = SpanRow(
                run.run_id,
                run.trace_id,
                run.root_span_id,
                None,
                f"invoke_workflow {run.run_id}",
                INTERNAL,
                start,
                max([start, *ends]),
                0,
                None,
                None,
                None,
            )
        spans.append(builder.root(root))
    spans.sort(key=lambda s: (s.envelope.start_us, s.envelope.trace_id, s.envelope.span_id))
    trace_ids = tuple(sorted({s.envelope.trace_id for s in spans}))
    return RunTrace(run.run_id, tuple(spans), without_span, trace_ids)


def services(spans: Iterable[TraceSpan]) -> list[str | None]:
    """The services of ``spans``, in first-seen order."""
    seen: dict[str | None, None] = {}
    for span in spans:
        seen.setdefault(span.envelope.service_name, None)
    return list(seen)
