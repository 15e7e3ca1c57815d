"""Pure layout of a run for display: each agent's events in sequence order, with every child
agent's block placed under the spawn event that created it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from otel_agentcap.model import AgentRecord, Event, EventType


@dataclass(frozen=True, slots=True)
class Line:
    depth: int
    event: Event | None  # None for an agent header line
    agent: AgentRecord


def _summary_fields(event: Event) -> str:
    payload = event.payload if isinstance(event.payload, dict) else {}
    if event.event_type in (EventType.TOOL_INVOCATION, EventType.TOOL_RESULT):
        return f"{payload.get('tool', '')} [{payload.get('invocation_id', '')}]"
    if event.event_type in (EventType.MEMORY_READ, EventType.MEMORY_WRITE):
        return f"{payload.get('memory', '')}[{payload.get('key', '')!r}]"
    if event.event_type == EventType.AGENT_SPAWN:
        return f"-> {payload.get('child_agent_id', '')}"
    if event.event_type == EventType.AGENT_ERROR:
        return f"{payload.get('error_type', '')}: {payload.get('message', '')}"[:120]
    if event.event_type == EventType.MODEL_CALL:
        raw_usage = payload.get("usage")
        usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
        tokens = f"{usage.get('input_tokens', '?')} in / {usage.get('output_tokens', '?')} out"
        tools = payload.get("tool_use_ids") or []
        asked = f", {len(tools)} tool_use" if tools else ""
        return f"{payload.get('model', '')} [{payload.get('status', '')}] {tokens}{asked}"
    return ""


def summary(event: Event) -> str:
    """A one-line description of an event's payload."""
    try:
        return _summary_fields(event)
    except Exception:
        return ""


def layout(events: Iterable[Event], agents: Iterable[AgentRecord]) -> Iterator[Line]:
    """Lines for a run: root agents in order of their first event, children under their spawn."""
    by_agent: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        by_agent[event.agent_id].append(event)
    for evs in by_agent.values():
        evs.sort(key=lambda e: e.seq)
    records = {a.agent_id: a for a in agents}
    for agent_id in by_agent:
        records.setdefault(agent_id, AgentRecord(run_id="", agent_id=agent_id))
    children_at: dict[str, list[str]] = defaultdict(list)
    for record in records.values():
        if record.spawned_at_event_id is not None and record.parent_agent_id in records:
            children_at[record.spawned_at_event_id].append(record.agent_id)
    placed: set[str] = set()

    def walk(agent_id: str, depth: int) -> Iterator[Line]:
        if agent_id in placed:
            return
        placed.add(agent_id)
        record = records[agent_id]
        yield Line(depth, None, record)
        for event in by_agent.get(agent_id, []):
            yield Line(depth + 1, event, record)
            for child in sorted(children_at.get(event.event_id, [])):
                yield from walk(child, depth + 2)

    def first_seq(agent_id: str) -> tuple[int, str]:
        evs = by_agent.get(agent_id)
        return (evs[0].seq if evs else 0, agent_id)

    roots = [a for a in records if records[a].parent_agent_id not in records]
    for agent_id in sorted(roots, key=first_seq):
        yield from walk(agent_id, 0)
    # Agents whose spawn event is not stored (yet): still shown, never dropped.
    for agent_id in sorted(set(records) - placed, key=first_seq):
        yield from walk(agent_id, 0)
