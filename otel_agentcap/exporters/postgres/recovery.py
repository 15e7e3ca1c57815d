"""What processes serving one run share in the database, written when it happens: the spawn
registry (a spawn retried in any process, at any moment, gets the same child and spawn event, even
before the first spawn's span was exported) and the run registry (a run is claimed when it opens);
and the lookup of spawns an earlier version exported."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from opentelemetry.trace import SpanContext

from otel_agentcap.capture.agents import SpawnClaim, SpawnRecord
from otel_agentcap.capture.runs import StoredRun
from otel_agentcap.exporters.postgres.database import Database, rows_waiting_for_locks_at_most
from otel_agentcap.exporters.postgres.errors import LockWaitTimeout
from otel_agentcap.model import EventRef
from otel_agentcap.pipeline.sampling import stored_trace_flags

_FIND = """
SELECT a.parent_agent_id, a.name, a.spawned_at_event_id::text, e.logical_seq, e.trace_id, e.span_id
FROM agentcap.agents a
JOIN agentcap.events e ON e.run_id = a.run_id AND e.event_id = a.spawned_at_event_id
     AND e.run_started_at = (SELECT started_at FROM agentcap.runs WHERE run_id = %(run)s)
WHERE a.run_id = %(run)s AND a.agent_id = %(agent)s AND a.parent_agent_id IS NOT NULL
"""

_REGISTER = b"SELECT * FROM agentcap.spawn_register(%s, %s, %s, %s, %s, %s, %s, %s, %s)"

_FIND_REGISTERED = b"""
SELECT parent_agent_id, name, spawn_event_id::text, spawn_seq, trace_id, span_id
FROM agentcap.spawns WHERE run_id = %(run)s AND child_agent_id = %(child)s
UNION ALL
SELECT a.parent_agent_id, a.name, a.spawned_at_event_id::text, e.logical_seq, e.trace_id, e.span_id
FROM agentcap.agents a
JOIN agentcap.events e ON e.run_id = a.run_id AND e.event_id = a.spawned_at_event_id
     AND e.run_started_at = (SELECT started_at FROM agentcap.runs WHERE run_id = %(run)s)
WHERE a.run_id = %(run)s AND a.agent_id = %(child)s AND a.parent_agent_id IS NOT NULL
LIMIT 1
"""

# A run id db prune removed is taken too: its row is gone, but writers refuse it (pruned_runs).
_CLAIM = """
INSERT INTO agentcap.runs (run_id, started_at, trace_id, root_span_id)
SELECT %(run)s, %(start)s, %(trace)s, %(span)s
WHERE NOT EXISTS (SELECT 1 FROM agentcap.pruned_runs WHERE run_id = %(run)s)
ON CONFLICT (run_id) DO NOTHING
RETURNING run_id
"""

_STORED_RUN = "SELECT trace_id, root_span_id FROM agentcap.runs WHERE run_id = %s"


def span_context_of(trace_id: object, span_id: object) -> SpanContext | None:
    """The remote span context of hex ids as the log stores them, sampled as this process's
    sampler samples a new root span of that trace (``sampling.stored_trace_flags``); None when
    absent or not valid hex."""
    if not isinstance(trace_id, str) or not isinstance(span_id, str):
        return None
    try:
        trace_number, span_number = int(trace_id, 16), int(span_id, 16)
        context = SpanContext(trace_number, span_number, is_remote=True)
    except ValueError:
        return None
    if not context.is_valid:
        return None
    return SpanContext(
        trace_number, span_number, is_remote=True, trace_flags=stored_trace_flags(trace_number)
    )


def _hex(context: SpanContext | None) -> tuple[str | None, str | None]:
    if context is None or not context.is_valid:
        return None, None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


class PostgresSpawnLookup:
    """A :class:`~otel_agentcap.capture.agents.SpawnLookup` over ``agentcap.agents``, with the
    spawn's span (the child runs under it, in the run's trace).

    It sees spawns that an earlier process exported; a spawn still in another live process's
    export queue is not visible yet (that process's own registry answers its own retries)."""

    def __init__(self, database: Database, *, timeout: float = 2.0) -> None:
        self._database = database
        self._timeout = timeout

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        with self._database.quick_connection(self._timeout) as conn:
            row = conn.execute(_FIND, {"run": run_id, "agent": child_agent_id}).fetchone()
            conn.rollback()
        if row is None:
            return None
        parent, name, event_id, seq, trace_id, span_id = row
        span = span_context_of(trace_id, span_id)
        return SpawnRecord(
            str(parent), name, EventRef(str(event_id), int(seq), str(parent), span), span
        )


def is_claimed(spawned_at: EventRef, claim: SpawnClaim) -> bool:
    """Whether the registered spawn ``spawned_at`` is the one ``claim`` stands for."""
    return (spawned_at.event_id, spawned_at.seq) == (claim.spawn_event_id, claim.spawn_seq)


class PostgresSpawnRegistry:
    """A :class:`~otel_agentcap.capture.agents.SpawnRegistry` over ``agentcap.spawns``
    (migration 0005), in autocommit mode: a spawn first looks its child up (one statement; a retry
    ends there, with no span), and the first spawn of a child registers it (one statement,
    ``agentcap.spawn_register``, insert-or-get). Spawns that a process of an earlier version
    exported without registering them (found in ``agents`` and ``events``) count as registered."""

    def __init__(self, database: Database, *, timeout: float = 2.0) -> None:
        self._database = database
        self._timeout = timeout

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        """The registered spawn of the child (or one an earlier version exported); one
        statement. A retry that finds it starts no span."""
        row = self._first_row(_FIND_REGISTERED, {"run": run_id, "child": child_agent_id})
        if row is None:
            return None
        parent, name, event_id, seq, trace_id, span_id = row
        span = span_context_of(trace_id, span_id)
        return SpawnRecord(
            str(parent), name, EventRef(str(event_id), int(seq), str(parent), span), span
        )

    def register(self, claim: SpawnClaim) -> SpawnRecord:
        params = (
            claim.run_id,
            claim.child_agent_id,
            claim.parent_agent_id,
            claim.name,
            claim.key,
            claim.spawn_event_id,
            claim.spawn_seq,
            claim.trace_id,
            claim.span_id,
        )
        row = self._first_row(_REGISTER, params)
        assert row is not None
        inserted, parent, name, event_id, seq, trace_id, span_id = row
        span = span_context_of(trace_id, span_id)
        spawned_at = EventRef(str(event_id), int(seq), str(parent), span)
        return SpawnRecord(
            str(parent),
            name,
            spawned_at,
            span,
            # The claim's spawn is the registered one also when this did not insert it: a
            # retry, or another process of the host that registered it on the claim's behalf.
            won=bool(inserted) or is_claimed(spawned_at, claim),
        )

    def _first_row(self, query: bytes, params: Any) -> tuple[Any, ...] | None:
        """Raises ``LockWaitTimeout`` when the statement waited too long for a lock."""
        with self._database.coordination(self._timeout) as conn:
            try:
                rows = rows_waiting_for_locks_at_most(conn, self._database, query, params)
                return rows[0] if rows else None
            except psycopg.errors.LockNotAvailable as exc:
                locked = exc  # raised outside: a lock is not an outage (no cool-down)
        raise LockWaitTimeout(f"the spawn registry waited too long for a lock: {locked}")


class PostgresRunRegistry:
    """A :class:`~otel_agentcap.capture.runs.RunRegistry` over ``agentcap.runs``: a run opened
    with a new id inserts its row (with the root span's ids) at once, so a second ``run()`` of
    the same id, in any process, finds it."""

    def __init__(self, database: Database, *, timeout: float = 2.0) -> None:
        self._database = database
        self._timeout = timeout

    def claim(
        self, run_id: str, root_span: SpanContext | None, started_at: datetime
    ) -> StoredRun | None:
        trace_id, span_id = _hex(root_span)
        with self._database.quick_connection(self._timeout) as conn, conn.transaction():
            created = conn.execute(
                _CLAIM, {"run": run_id, "start": started_at, "trace": trace_id, "span": span_id}
            ).fetchone()
            row = None if created else conn.execute(_STORED_RUN, (run_id,)).fetchone()
        if created:
            return None
        stored_trace, stored_span = row if row is not None else (None, None)
        return StoredRun(run_id, span_context_of(stored_trace, stored_span))
