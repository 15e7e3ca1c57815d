"""A run as the log holds it (run, agents, span envelopes, events, conflicts), read in one
repeatable-read transaction, in a fixed order, with values in the exact form every export writes
(times in microseconds since the epoch, JSON as PostgreSQL's canonical ``jsonb`` text), so that the
same log always exports to the same bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import psycopg

from otel_agentcap.exporters.postgres.errors import RunNotFound


@dataclass(frozen=True, slots=True)
class RunRow:
    run_id: str
    started_at_us: int | None
    attributes_json: str
    trace_id: str | None
    root_span_id: str | None


@dataclass(frozen=True, slots=True)
class AgentRow:
    run_id: str
    agent_id: str
    name: str | None
    parent_agent_id: str | None
    spawned_at_event_id: str | None


@dataclass(frozen=True, slots=True)
class EventRow:
    event_id: str
    run_id: str
    agent_id: str
    logical_seq: int
    wall_time_us: int
    event_type: str
    causal_parent_ids: tuple[str, ...]
    idempotency_key: str
    trace_id: str | None
    span_id: str | None
    payload_json: str | None


@dataclass(frozen=True, slots=True)
class SpanRow:
    run_id: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: int
    start_us: int
    end_us: int
    status_code: int
    status_message: str | None
    service_name: str | None
    scope_name: str | None


@dataclass(frozen=True, slots=True)
class ConflictRow:
    reason: str
    existing_event_id: str | None
    detected_at_us: int
    row_digest: str
    event: EventRow


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    run: RunRow
    agents: tuple[AgentRow, ...]
    spans: tuple[SpanRow, ...]
    events: tuple[EventRow, ...]
    conflicts: tuple[ConflictRow, ...]


def _us(column: str) -> str:
    return f"(extract(epoch FROM {column}) * 1000000)::bigint"


# The run's start is read first, then every query names it, so each reads the run's partition
# only (see otel_agentcap.exporters.postgres.store).
_RUN: Final = f"""
SELECT run_id, {_us("started_at")}, attributes::text, trace_id, root_span_id, started_at
FROM agentcap.runs WHERE run_id = %s
"""
_AGENTS: Final = """
SELECT run_id, agent_id, name, parent_agent_id, spawned_at_event_id::text
FROM agentcap.agents WHERE run_id = %s ORDER BY agent_id
"""
_SPANS: Final = f"""
SELECT run_id, trace_id, span_id, parent_span_id, name, kind, {_us("start_time")},
       {_us("end_time")}, status_code, status_message, service_name, scope_name
FROM agentcap.spans WHERE run_id = %s AND run_started_at = %s ORDER BY trace_id, span_id
"""
_EVENT_COLUMNS: Final = f"""event_id::text, run_id, agent_id, logical_seq, {_us("wall_time")},
       event_type, causal_parent_ids::text[], idempotency_key, trace_id, span_id, payload::text"""
_EVENTS: Final = f"""
SELECT {_EVENT_COLUMNS}
FROM agentcap.events WHERE run_id = %s AND run_started_at = %s
ORDER BY agent_id, logical_seq, event_id
"""
_CONFLICTS: Final = f"""
SELECT reason, existing_event_id::text, {_us("detected_at")}, row_digest, {_EVENT_COLUMNS}
FROM agentcap.conflicts WHERE run_id = %s AND run_started_at = %s
ORDER BY agent_id, logical_seq, event_id, reason, row_digest
"""


def _event(values: tuple[Any, ...]) -> EventRow:
    (event_id, run, agent, seq, wall, kind, parents, key, trace, span, payload) = values
    return EventRow(
        event_id,
        run,
        agent,
        int(seq),
        int(wall),
        kind,
        tuple(parents or ()),
        key,
        trace,
        span,
        payload,
    )


def _agent(r: tuple[Any, ...]) -> AgentRow:
    return AgentRow(*r)


def _span(r: tuple[Any, ...]) -> SpanRow:
    return SpanRow(
        r[0], r[1], r[2], r[3], r[4], int(r[5]), int(r[6]), int(r[7]), int(r[8]), r[9], r[10], r[11]
    )


def _conflict(r: tuple[Any, ...]) -> ConflictRow:
    return ConflictRow(r[0], r[1], int(r[2]), r[3], _event(tuple(r[4:])))


_COUNTS: Final = """
SELECT (SELECT count(*) FROM agentcap.agents WHERE run_id = %(run)s),
       (SELECT count(*) FROM agentcap.spans WHERE run_id = %(run)s AND run_started_at = %(at)s),
       (SELECT count(*) FROM agentcap.events WHERE run_id = %(run)s AND run_started_at = %(at)s),
       (SELECT count(*) FROM agentcap.conflicts
        WHERE run_id = %(run)s AND run_started_at = %(at)s)
"""

#: Rows a server-side cursor of :class:`RunReader` fetches at a time.
FETCH_ROWS: Final = 1000

_Row = TypeVar("_Row")


@dataclass(frozen=True, slots=True)
class RowCounts:
    agents: int
    spans: int
    events: int
    conflicts: int


class RunReader:
    """A run as :func:`load_run` reads it, row by row: each kind of row from a server-side cursor
    that fetches :data:`FETCH_ROWS` rows at a time, inside the repeatable-read transaction of
    :func:`read_run`, so that memory does not grow with the run. Read each kind once, in the order
    agents, spans, events, conflicts (one cursor is open at a time)."""

    def __init__(
        self, conn: psycopg.Connection[Any], run: RunRow, started: Any, counts: RowCounts
    ) -> None:
        self._conn = conn
        self.run = run
        self._routed = {"run": run.run_id, "at": started}
        self.counts = counts

    def _rows(
        self, name: str, query: str, params: Any, make: Callable[[tuple[Any, ...]], _Row]
    ) -> Iterator[_Row]:
        with self._conn.cursor(name=f"agentcap_export_{name}") as cursor:
            cursor.itersize = FETCH_ROWS
            cursor.execute(query, params)
            for row in cursor:
                yield make(row)

    def agents(self) -> Iterator[AgentRow]:
        return self._rows("agents", _AGENTS, (self.run.run_id,), _agent)

    def spans(self) -> Iterator[SpanRow]:
        routed = (self.run.run_id, self._routed["at"])
        return self._rows("spans", _SPANS, routed, _span)

    def events(self) -> Iterator[EventRow]:
        routed = (self.run.run_id, self._routed["at"])
        return self._rows("events", _EVENTS, routed, _event)

    def conflicts(self) -> Iterator[ConflictRow]:
        routed = (self.run.run_id, self._routed["at"])
        return self._rows("conflicts", _CONFLICTS, routed, _conflict)

    def snapshot(self) -> RunSnapshot:
        """Every row of the run, in memory (what :func:`load_run` gives)."""
        return RunSnapshot(
            self.run,
            tuple(self.agents()),
            tuple(self.spans()),
            tuple(self.events()),
            tuple(self.conflicts()),
        )


@contextmanager
def read_run(conn: psycopg.Connection[Any], run_id: str) -> Iterator[RunReader]:
    """A :class:`RunReader` of ``run_id``, valid inside the ``with`` block (one repeatable-read,
    read-only transaction); raises ``RunNotFound`` when the log holds nothing of it."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        run = conn.execute(_RUN, (run_id,)).fetchone()
        if run is None:
            raise RunNotFound(run_id)
        counts = conn.execute(_COUNTS, {"run": run_id, "at": run[5]}).fetchone()
        assert counts is not None
        run_row = RunRow(run[0], None if run[1] is None else int(run[1]), run[2], run[3], run[4])
        yield RunReader(conn, run_row, run[5], RowCounts(*(int(c) for c in counts)))


def load_run(conn: psycopg.Connection[Any], run_id: str) -> RunSnapshot:
    """Everything the log holds of ``run_id``; raises ``RunNotFound`` when it holds nothing (every
    stored row of a run belongs to its runs row)."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        run = conn.execute(_RUN, (run_id,)).fetchone()
        if run is None:
            raise RunNotFound(run_id)
        routed = (run_id, run[5])
        agents = conn.execute(_AGENTS, (run_id,)).fetchall()
        spans = conn.execute(_SPANS, routed).fetchall()
        events = conn.execute(_EVENTS, routed).fetchall()
        conflicts = conn.execute(_CONFLICTS, routed).fetchall()
    run_row = RunRow(run[0], None if run[1] is None else int(run[1]), run[2], run[3], run[4])
    return RunSnapshot(
        run_row,
        tuple(_agent(row) for row in agents),
        tuple(_span(r) for r in spans),
        tuple(_event(row) for row in events),
        tuple(_conflict(r) for r in conflicts),
    )
