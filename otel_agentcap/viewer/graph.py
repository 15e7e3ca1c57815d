"""Pure layout of a run for the web view: lanes in spawn-tree order, one column per logical
sequence, events as parallel arrays with their causal parents as indexes.

The document :func:`run_graph_document` builds is what the browser draws from (served as JSON, or
embedded in an exported HTML file). Events are numbered in lane order, then sequence order, so an
agent's events are contiguous and ``i - 1`` is the previous event of the same agent when both are
in one lane. Nothing here reads a payload.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from otel_agentcap.exporters.postgres.store import ConflictRow, GraphRow
from otel_agentcap.model import AgentRecord, EventType

#: Event types in the order the document's ``types`` list names them (the browser maps type
#: indexes to shapes and labels). Types outside the schema's list get indexes after these.
EVENT_TYPE_ORDER: Final = tuple(t.value for t in EventType)

#: The largest integer a JavaScript number holds exactly; larger sequences are sent as strings.
_MAX_SAFE_INTEGER: Final = 2**53 - 1


@dataclass(frozen=True, slots=True)
class Lane:
    agent_id: str
    name: str | None
    parent_agent_id: str | None
    depth: int
    #: Event index of the spawn that created this agent, when it is stored.
    spawn: int | None


def lane_order(
    agents: Iterable[AgentRecord],
    first_seq: Mapping[str, int],
    spawn_seq: Mapping[str, int],
) -> list[tuple[AgentRecord, int]]:
    """Agents in spawn-tree order with their depth: each child right under its parent's subtree
    position, siblings by the sequence of their spawn (else their first event), roots by their
    first event. Agents whose parent is unknown are roots; a cycle in bad data is cut, never
    looped, and every agent appears exactly once."""
    records = {a.agent_id: a for a in agents}
    children: dict[str, list[str]] = defaultdict(list)
    roots: list[str] = []
    for agent_id, record in records.items():
        parent = record.parent_agent_id
        if parent is not None and parent in records and parent != agent_id:
            children[parent].append(agent_id)
        else:
            roots.append(agent_id)

    def first(agent_id: str) -> tuple[int, int, str]:
        return (0, first_seq.get(agent_id, 0), agent_id)

    def spawned(agent_id: str) -> tuple[int, int, str]:
        seq = spawn_seq.get(agent_id)
        if seq is None:
            return (1, first_seq.get(agent_id, 0), agent_id)
        return (0, seq, agent_id)

    ordered: list[tuple[AgentRecord, int]] = []
    placed: set[str] = set()

    def walk(start: str, depth: int) -> None:
        stack = [(start, depth)]
        while stack:
            agent_id, level = stack.pop()
            if agent_id in placed:
                continue
            placed.add(agent_id)
            ordered.append((records[agent_id], level))
            for child in sorted(children.get(agent_id, ()), key=spawned, reverse=True):
                stack.append((child, level + 1))

    for root in sorted(roots, key=first):
        walk(root, 0)
    # Agents on a parent cycle (bad data) have no root: each still gets a lane.
    for agent_id in sorted(set(records) - placed, key=first):
        walk(agent_id, 0)
    return ordered


def seq_json(seq: int) -> int | str:
    """``seq`` as JSON that a browser reads exactly: a number, or text beyond 2**53 - 1."""
    return seq if -_MAX_SAFE_INTEGER <= seq <= _MAX_SAFE_INTEGER else str(seq)


def run_graph_document(
    agents: Sequence[AgentRecord],
    rows: Sequence[GraphRow],
    conflicts: Sequence[ConflictRow] = (),
    moved: Mapping[str, str] | None = None,
    *,
    with_ids: bool = False,
) -> dict[str, Any]:
    """The JSON-ready graph of a run (``with_ids``: also ``id``, the event ids in index order).

    ``moved`` maps ids of records kept in ``agentcap.conflicts`` to the stored event they
    collided with, so a causal parent naming such a record points at the stored event. Keys:

    - ``lanes``: ``[{agent, name, parent, depth, spawn}]`` in display order;
    - ``seqs``: the distinct sequences of the run's events and conflicts, ascending (column ``c``
      shows sequence ``seqs[c]``);
    - ``types``: event type names; ``lane``, ``col``, ``type``: one entry per event (its sequence
      is ``seqs[col]``; ids and payloads are fetched per event); ``pstart`` / ``parents``: the parents of event ``i`` are
      ``parents[pstart[i]:pstart[i + 1]]`` (event indexes, in the order the log lists them);
      ``missing``: ``[[i, parent_id]]`` for parents not stored;
    - ``conflicts``: ``[{id, reason, existing, lane, col, type, event_id}]`` where ``existing``
      is the index of the stored event it collided with (or ``None``).
    """
    moved = moved or {}
    known = {a.agent_id: a for a in agents}
    for agent_id in dict.fromkeys([r.agent_id for r in rows] + [c.agent_id for c in conflicts]):
        known.setdefault(agent_id, AgentRecord(run_id="", agent_id=agent_id))

    by_id = {row.event_id: row for row in rows}
    first_seq: dict[str, int] = {}
    for row in rows:  # rows come in (agent, seq) order, but do not rely on it
        if row.seq < first_seq.get(row.agent_id, row.seq + 1):
            first_seq[row.agent_id] = row.seq
    with_events = set(first_seq)
    for conflict in conflicts:  # an agent known only from its conflicts sits where they are
        if conflict.agent_id not in with_events:
            known_seq = first_seq.get(conflict.agent_id, conflict.seq)
            first_seq[conflict.agent_id] = min(known_seq, conflict.seq)
    spawn_seq: dict[str, int] = {}
    for record in known.values():
        spawn = by_id.get(record.spawned_at_event_id or "")
        if spawn is not None and spawn.agent_id == record.parent_agent_id:
            spawn_seq[record.agent_id] = spawn.seq

    ordered = lane_order(known.values(), first_seq, spawn_seq)
    lane_of = {record.agent_id: n for n, (record, _) in enumerate(ordered)}
    ordered_rows = sorted(rows, key=lambda r: (lane_of[r.agent_id], r.seq))
    index = {row.event_id: i for i, row in enumerate(ordered_rows)}

    seqs = sorted({r.seq for r in rows} | {c.seq for c in conflicts})
    col_of = {seq: c for c, seq in enumerate(seqs)}

    types = list(EVENT_TYPE_ORDER)
    type_of = {name: n for n, name in enumerate(types)}
    for row in ordered_rows:
        if row.event_type not in type_of:
            type_of[row.event_type] = len(types)
            types.append(row.event_type)

    pstart = [0]
    parents: list[int] = []
    missing: list[list[Any]] = []
    for i, row in enumerate(ordered_rows):
        seen: set[int] = set()
        for parent_id in row.causal_parent_ids:
            p = index.get(parent_id)
            if p is None and parent_id in moved:
                p = index.get(moved[parent_id])
            if p is None:
                missing.append([i, parent_id])
            elif p != i and p not in seen:
                seen.add(p)
                parents.append(p)
        pstart.append(len(parents))

    lanes = []
    for record, depth in ordered:
        spawn_index = index.get(record.spawned_at_event_id or "")
        lanes.append(
            {
                "agent": record.agent_id,
                "name": record.name,
                "parent": record.parent_agent_id,
                "depth": depth,
                "spawn": spawn_index if record.agent_id in spawn_seq else None,
            }
        )

    document: dict[str, Any] = {
        "lanes": lanes,
        "seqs": [seq_json(s) for s in seqs],
        "types": types,
        "lane": [lane_of[row.agent_id] for row in ordered_rows],
        "col": [col_of[row.seq] for row in ordered_rows],
        "type": [type_of[row.event_type] for row in ordered_rows],
        "pstart": pstart,
        "parents": parents,
        "missing": missing,
        "conflicts": [
            {
                "id": c.conflict_id,
                "reason": c.reason,
                "existing": index.get(c.existing_event_id or ""),
                "lane": lane_of[c.agent_id],
                "col": col_of[c.seq],
                "type": c.event_type,
                "event_id": c.event_id,
                "detected_at": c.detected_at.isoformat(),
            }
            for c in conflicts
        ],
    }
    if with_ids:
        document["id"] = [row.event_id for row in ordered_rows]
    return document
