"""The JSON documents the web view reads, built from the storage layer's read queries.

Each function takes an open connection and returns plain JSON-ready data (datetimes as ISO 8601
text, payloads as the JSON text PostgreSQL stores). The server sends them as they are; the HTML
export embeds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import psycopg

from otel_agentcap.exporters.postgres import store
from otel_agentcap.model import Event
from otel_agentcap.tokens import RunScope

from .graph import run_graph_document, seq_json
from .labels import label

#: Most runs one page of the runs list holds.
MAX_RUNS_PAGE: Final = 500
#: PostgreSQL's OFFSET is a bigint: a larger offset is past every run all the same.
_MAX_OFFSET: Final = 2**63 - 1


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def totals_document(totals: store.RunTotals) -> dict[str, Any]:
    return {
        "run_id": totals.run_id,
        "started_at": _iso(totals.started_at),
        "first_wall_time": _iso(totals.first_wall_time),
        "last_wall_time": _iso(totals.last_wall_time),
        "duration_s": totals.duration_seconds,
        "attributes": totals.attributes,
        "agents": totals.agents,
        "events": totals.events,
        "model_calls": totals.model_calls,
        "input_tokens": totals.input_tokens,
        "output_tokens": totals.output_tokens,
        "tokens": totals.input_tokens + totals.output_tokens,
        "errors": totals.errors,
        "conflicts": totals.conflicts,
    }


def runs_document(
    conn: psycopg.Connection[Any],
    *,
    limit: int = 200,
    offset: int = 0,
    search: str | None = None,
    scope: RunScope | None = None,
) -> dict[str, Any]:
    """A page of the runs list, newest first (``more``: whether another page follows); with a
    ``scope``, of the runs it allows only."""
    limit = max(1, min(limit, MAX_RUNS_PAGE))
    offset = max(0, min(offset, _MAX_OFFSET))
    runs = store.run_totals(
        conn,
        limit=limit + 1,
        offset=offset,
        search=search,
        within=None if scope is None else (sorted(scope.exact), list(scope.prefixes)),
    )
    return {
        "runs": [totals_document(r) for r in runs[:limit]],
        "more": len(runs) > limit,
        "offset": offset,
    }


def version_document(conn: psycopg.Connection[Any], run_id: str) -> dict[str, Any]:
    return {"version": list(store.run_version(conn, run_id))}


def run_document(
    conn: psycopg.Connection[Any], run_id: str, *, with_ids: bool = False
) -> dict[str, Any]:
    """A run's totals and graph (no payloads); ``RunNotFound`` if it is not stored."""
    version = store.run_version(conn, run_id)  # first, so a later poll sees anything added since
    totals = store.run_totals_of(conn, run_id)
    agents = store.run_agents(conn, run_id)
    rows = store.run_graph(conn, run_id)
    conflicts = store.run_conflicts(conn, run_id)
    stored = {row.event_id for row in rows}
    dangling = sorted({p for row in rows for p in row.causal_parent_ids if p not in stored})
    moved = store.moved_events(conn, run_id, dangling)
    return {
        "run": totals_document(totals),
        "graph": run_graph_document(agents, rows, conflicts, moved, with_ids=with_ids),
        "version": list(version),
    }


def labels_document(
    conn: psycopg.Connection[Any],
    run_id: str,
    seq_from: int,
    seq_to: int,
    agent_ids: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``labels``: ``[agent_id, seq, label]`` for the events in a window of sequences (a sequence
    beyond JavaScript's exact integers is sent as text, as in the graph's ``seqs``)."""
    rows = store.event_labels(conn, run_id, seq_from, seq_to, agent_ids)
    return {
        "labels": [
            [agent, seq_json(seq), label(kind, fields, agent)] for agent, seq, kind, fields in rows
        ]
    }


def conflict_fields(row: store.ConflictRow) -> dict[str, Any]:
    return {
        "id": row.conflict_id,
        "detected_at": _iso(row.detected_at),
        "reason": row.reason,
        "existing_event_id": row.existing_event_id,
        "event_id": row.event_id,
        "agent_id": row.agent_id,
        "seq": row.seq,
        "event_type": row.event_type,
        "wall_time": _iso(row.wall_time),
        "causal_parent_ids": list(row.causal_parent_ids),
        "idempotency_key": row.idempotency_key,
        "trace_id": row.trace_id,
        "span_id": row.span_id,
        "payload": row.payload,
    }


def event_fields(event: Event) -> dict[str, Any]:
    """An event as the detail panel reads it; ``payload`` is its stored JSON text."""
    return {
        "event_id": event.event_id,
        "agent_id": event.agent_id,
        "seq": event.seq,
        "event_type": event.event_type,
        "wall_time": _iso(event.wall_time),
        "idempotency_key": event.idempotency_key,
        "causal_parent_ids": list(event.causal_parent_ids),
        "trace_id": event.trace_id,
        "span_id": event.span_id,
        "payload": event.payload,
    }


def event_document(
    conn: psycopg.Connection[Any], run_id: str, agent_id: str, seq: int
) -> dict[str, Any]:
    """One event with its payload and the conflicts that collided with it."""
    event = store.event_detail(conn, run_id, agent_id, seq)
    if event is None:
        raise LookupError(f"no event of agent {agent_id!r} at seq {seq} in run {run_id!r}")
    return {
        "event": event_fields(event),
        "conflicts": [conflict_fields(c) for c in store.event_conflicts(conn, event)],
    }


def conflict_document(
    conn: psycopg.Connection[Any], run_id: str, conflict_id: int
) -> dict[str, Any]:
    row = store.conflict_detail(conn, run_id, conflict_id)
    if row is None:
        raise LookupError(f"no conflict {conflict_id} in run {run_id!r}")
    return {"conflict": conflict_fields(row)}
