"""Pure layout of a run for display: each agent's events in sequence order, with every child
agent's block placed under the spawn event that created it; which event each causal parent is;
and the totals of the run and of each agent."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
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


@dataclass(slots=True)
class Totals:
    """What a run, or one agent of it, did: counted from its events (and its conflicts)."""

    events: int = 0
    model_calls: int = 0
    model_call_errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    #: Sum of the model calls' latencies (request start to the end of the response).
    model_latency_ms: float = 0.0
    tool_calls: int = 0
    tool_failures: int = 0
    memory_reads: int = 0
    memory_writes: int = 0
    spawns: int = 0
    agent_errors: int = 0
    conflicts: int = 0

    def add(self, event: Event) -> None:
        self.events += 1
        payload = event.payload if isinstance(event.payload, dict) else {}
        kind = event.event_type
        if kind == EventType.MODEL_CALL:
            self.model_calls += 1
            if payload.get("status") == "error":
                self.model_call_errors += 1
            usage = payload.get("usage")
            if isinstance(usage, dict):
                self.input_tokens += _count(usage.get("input_tokens"))
                self.output_tokens += _count(usage.get("output_tokens"))
                self.cache_read_input_tokens += _count(usage.get("cache_read_input_tokens"))
                self.cache_creation_input_tokens += _count(usage.get("cache_creation_input_tokens"))
            latency = payload.get("latency_ms")
            if isinstance(latency, int | float) and not isinstance(latency, bool):
                self.model_latency_ms += float(latency)
        elif kind == EventType.TOOL_INVOCATION:
            self.tool_calls += 1
        elif kind == EventType.AGENT_ERROR:
            # A tool's error names its invocation; any other is the agent execution's own.
            if "invocation_id" in payload:
                self.tool_failures += 1
            else:
                self.agent_errors += 1
        elif kind == EventType.MEMORY_READ:
            self.memory_reads += 1
        elif kind == EventType.MEMORY_WRITE:
            self.memory_writes += 1
        elif kind == EventType.AGENT_SPAWN:
            self.spawns += 1


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def totals(
    events: Iterable[Event], conflicts_by_agent: Mapping[str, int] | None = None
) -> tuple[Totals, dict[str, Totals]]:
    """The totals of a run and of each of its agents (sorted by agent id)."""
    run = Totals()
    by_agent: dict[str, Totals] = {}
    for event in events:
        run.add(event)
        agent = by_agent.get(event.agent_id)
        if agent is None:
            agent = by_agent[event.agent_id] = Totals()
        agent.add(event)
    for agent_id, count in (conflicts_by_agent or {}).items():
        by_agent.setdefault(agent_id, Totals()).conflicts += count
        run.conflicts += count
    return run, dict(sorted(by_agent.items()))


def event_positions(
    events: Iterable[Event], elsewhere: Mapping[str, tuple[str, int]] | None = None
) -> dict[str, tuple[str, int]]:
    """``(agent_id, seq)`` of each event id: the run's events, and ``elsewhere`` (the stored event
    a conflicting record's id stands for, say) for ids that are not among them."""
    positions = dict(elsewhere or {})
    positions.update({e.event_id: (e.agent_id, e.seq) for e in events})
    return positions


def parent_text(event: Event, positions: Mapping[str, tuple[str, int]]) -> str:
    """``<- #5, planner#3``: which event each causal parent is, by sequence in the event's own
    agent and ``agent#seq`` in another (the start of its id when it is not in the log)."""
    if not event.causal_parent_ids:
        return ""
    names = []
    for parent in event.causal_parent_ids:
        position = positions.get(parent)
        if position is None:
            names.append(f"{parent[:8]} (not stored)")
        elif position[0] == event.agent_id:
            names.append(f"#{position[1]}")
        else:
            names.append(f"{position[0]}#{position[1]}")
    return "<- " + ", ".join(names)
