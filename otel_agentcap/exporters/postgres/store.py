"""Read-side queries over the agentcap schema, for the command-line tool and tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.rows import class_row

from otel_agentcap.model import AgentRecord, Event

from .errors import ConnectionFailed, RunNotFound, SchemaNotReady


@dataclass(frozen=True, slots=True)
class RunSummary:
    run_id: str
    started_at: datetime | None
    attributes: dict[str, Any]
    agents: int
    events: int
    first_wall_time: datetime | None
    last_wall_time: datetime | None


_LIST_RUNS: Final = b"""
SELECT r.run_id, r.started_at, r.attributes,
       (SELECT count(*) FROM agentcap.agents a WHERE a.run_id = r.run_id) AS agents,
       s.events, s.first_wall_time, s.last_wall_time
FROM agentcap.runs r
CROSS JOIN LATERAL (
    SELECT count(*) AS events, min(e.wall_time) AS first_wall_time, max(e.wall_time) AS last_wall_time
    FROM agentcap.events e WHERE e.run_id = r.run_id
) s
ORDER BY r.started_at DESC NULLS LAST, r.run_id
LIMIT %s
"""

_EVENTS: Final = b"""
SELECT event_id::text, run_id, agent_id, logical_seq, event_type, idempotency_key, wall_time,
       causal_parent_ids::text[], payload, trace_id, span_id
FROM agentcap.events WHERE run_id = %s ORDER BY agent_id, logical_seq
"""

_AGENTS: Final = b"""
SELECT run_id, agent_id, name, parent_agent_id, spawned_at_event_id::text
FROM agentcap.agents WHERE run_id = %s ORDER BY agent_id
"""


def _run_exists(conn: psycopg.Connection[Any], run_id: str) -> bool:
    row = conn.execute(
        b"SELECT EXISTS (SELECT 1 FROM agentcap.runs WHERE run_id = %s)"
        b" OR EXISTS (SELECT 1 FROM agentcap.events WHERE run_id = %s)",
        (run_id, run_id),
    ).fetchone()
    return bool(row and row[0])


def _guard(exc: psycopg.Error) -> Exception:
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaNotReady(f"agentcap schema missing, run migrate(): {exc}")
    if isinstance(exc, psycopg.OperationalError):
        return ConnectionFailed(str(exc))
    return exc


def list_runs(conn: psycopg.Connection[Any], *, limit: int = 100) -> list[RunSummary]:
    """Most recent runs first, with agent and event counts and the wall-time span of their events."""
    try:
        with conn.cursor(row_factory=class_row(RunSummary)) as cur:
            return cur.execute(_LIST_RUNS, (limit,)).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc


def _event_row(cursor: Any) -> Any:
    def make(values: Sequence[Any]) -> Event:
        (event_id, run, agent, seq, event_type, key, wall_time, parents, payload, trace, span) = (
            values
        )
        return Event(
            event_id=event_id,
            run_id=run,
            agent_id=agent,
            seq=seq,
            event_type=event_type,
            idempotency_key=key,
            wall_time=wall_time,
            causal_parent_ids=tuple(parents),
            payload=payload,
            trace_id=trace,
            span_id=span,
        )

    return make


def run_events(conn: psycopg.Connection[Any], run_id: str) -> list[Event]:
    """All events of ``run_id`` in (agent_id, logical_seq) order; ``RunNotFound`` if unknown."""
    try:
        with conn.cursor(row_factory=_event_row) as cur:
            rows = cur.execute(_EVENTS, (run_id,)).fetchall()
        if not rows and not _run_exists(conn, run_id):
            raise RunNotFound(run_id)
        return rows
    except psycopg.Error as exc:
        raise _guard(exc) from exc


def run_agents(conn: psycopg.Connection[Any], run_id: str) -> list[AgentRecord]:
    """Agents of ``run_id`` with their parent links; ``RunNotFound`` if unknown."""
    try:
        with conn.cursor(row_factory=class_row(AgentRecord)) as cur:
            rows = cur.execute(_AGENTS, (run_id,)).fetchall()
        if not rows and not _run_exists(conn, run_id):
            raise RunNotFound(run_id)
        return rows
    except psycopg.Error as exc:
        raise _guard(exc) from exc


def conflicts_count(conn: psycopg.Connection[Any], run_id: str | None = None) -> int:
    """Number of recorded conflicts, overall or for one run."""
    try:
        if run_id is None:
            row = conn.execute(b"SELECT count(*) FROM agentcap.conflicts").fetchone()
        else:
            row = conn.execute(
                b"SELECT count(*) FROM agentcap.conflicts WHERE run_id = %s", (run_id,)
            ).fetchone()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return int(row[0]) if row else 0
