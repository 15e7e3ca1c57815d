"""Read-side queries over the agentcap schema, for the command-line tool, the views and tests.

Every query is routed by run: it names the run and the run's start, the partition key of its rows
(``agentcap.runs.started_at``, read first), so it reads one partition through an index that leads
with ``run_id``, and its cost does not grow with the number of other runs in the log.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, NamedTuple

import psycopg
from psycopg.rows import class_row

from otel_agentcap.model import AgentRecord, Event

from .errors import ConnectionFailed, EventNotFound, LockWaitTimeout, RunNotFound, SchemaNotReady

#: How long the commands (``otel-agentcap runs``, ``show``, ``event``, ``export``, ``import``,
#: ``db migrate``, ``db partitions``, ``db prune``) and the web view wait for a lock another
#: session holds on a table of the log (a migration, other DDL, a ``LOCK TABLE``) before they give
#: up, in seconds (``--lock-timeout``).
READ_LOCK_TIMEOUT: Final = 10.0

#: How long a write of the OTLP ingest waits for such a lock before the request is answered
#: "retry later" (``IngestLimits.lock_timeout``, ``otel-agentcap ingest --lock-timeout``): less
#: than a collector's export timeout, so the sender hears why.
INGEST_LOCK_TIMEOUT: Final = 5.0


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
    FROM agentcap.events e WHERE e.run_id = r.run_id AND e.run_started_at = r.started_at
) s
ORDER BY r.started_at DESC NULLS LAST, r.run_id
LIMIT %s
"""

_COLUMNS: Final = """e.event_id::text, e.run_id, e.agent_id, e.logical_seq, e.event_type,
       e.idempotency_key, e.wall_time, e.causal_parent_ids::text[], e.payload, e.trace_id, e.span_id"""

_EVENTS: Final = f"""
SELECT {_COLUMNS}
FROM agentcap.events e WHERE e.run_id = %(run)s AND e.run_started_at = %(start)s
ORDER BY e.agent_id, e.logical_seq
""".encode()

_EVENT: Final = f"""
SELECT {_COLUMNS}
FROM agentcap.events e
WHERE e.run_id = %(run)s AND e.run_started_at = %(start)s AND e.event_id = %(event)s
""".encode()

# A parent is looked up by its whole primary key, one id at a time (a LATERAL subquery with LIMIT
# 1 is not flattened into a join), which the planner answers by the index whatever its statistics
# say. Given "event_id = ANY (parents)", or a join, it scans the whole run instead when the
# partition has not been analyzed yet (it then takes the run for two rows).
_PARENT: Final = """
    SELECT x.* FROM agentcap.events x
    WHERE x.run_id = %(run)s AND x.run_started_at = %(start)s AND x.event_id = u.id
    LIMIT 1"""

_PARENTS: Final = f"""
SELECT {_COLUMNS}
FROM agentcap.events c
CROSS JOIN LATERAL unnest(c.causal_parent_ids) AS u(id)
CROSS JOIN LATERAL ({_PARENT}) e
WHERE c.run_id = %(run)s AND c.run_started_at = %(start)s AND c.event_id = %(event)s
ORDER BY e.agent_id, e.logical_seq
""".encode()

_CHILDREN: Final = f"""
SELECT {_COLUMNS}
FROM agentcap.events e
WHERE e.run_id = %(run)s AND e.run_started_at = %(start)s
  AND e.causal_parent_ids @> ARRAY[%(event)s::uuid]
ORDER BY e.agent_id, e.logical_seq
""".encode()

# Everything that happened before the event in Lamport's sense: walking back from it, the
# previous event of the same agent (program order) and the explicit causal parents (spawns, tool
# results, ...), transitively. Each step is two index probes within the run's partition, so the
# cost follows the size of the causal past, not of the log.
_PAST: Final = f"""
WITH RECURSIVE past(event_id, agent_id, logical_seq, parents) AS (
    SELECT e.event_id, e.agent_id, e.logical_seq, e.causal_parent_ids
    FROM agentcap.events e
    WHERE e.run_id = %(run)s AND e.run_started_at = %(start)s AND e.event_id = %(event)s
  UNION
    SELECT n.event_id, n.agent_id, n.logical_seq, n.causal_parent_ids
    FROM past p
    CROSS JOIN LATERAL (
        (SELECT x.event_id, x.agent_id, x.logical_seq, x.causal_parent_ids
         FROM agentcap.events x
         WHERE x.run_id = %(run)s AND x.run_started_at = %(start)s
           AND x.agent_id = p.agent_id AND x.logical_seq < p.logical_seq
         ORDER BY x.logical_seq DESC LIMIT 1)
        UNION ALL
        SELECT x.event_id, x.agent_id, x.logical_seq, x.causal_parent_ids
        FROM unnest(p.parents) AS u(id)
        CROSS JOIN LATERAL ({_PARENT}) x
    ) n
)
SELECT {_COLUMNS}
FROM past p
JOIN agentcap.events e ON e.run_id = %(run)s AND e.run_started_at = %(start)s
                      AND e.event_id = p.event_id
WHERE p.event_id <> %(event)s
ORDER BY e.agent_id, e.logical_seq
""".encode()

_AGENTS: Final = b"""
SELECT run_id, agent_id, name, parent_agent_id, spawned_at_event_id::text
FROM agentcap.agents WHERE run_id = %s ORDER BY agent_id
"""


def _start_of(conn: psycopg.Connection[Any], run_id: str) -> datetime | None:
    """The start of ``run_id`` (the partition key of its rows), or None for an unknown run: every
    stored event, agent and conflict belongs to a stored run."""
    try:
        row = conn.execute(
            b"SELECT started_at FROM agentcap.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return None if row is None else row[0]


def run_start(conn: psycopg.Connection[Any], run_id: str) -> datetime:
    """The start of ``run_id`` (the partition key of its rows); ``RunNotFound`` if unknown."""
    start = _start_of(conn, run_id)
    if start is None:
        raise RunNotFound(run_id)
    return start


def limit_lock_waits(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Make the queries of ``conn`` give up (``psycopg.errors.LockNotAvailable``, which the
    queries here raise as ``LockWaitTimeout``) when they wait longer than ``seconds`` for a lock
    another session holds; 0 waits without limit. The setting outlives the transaction."""
    milliseconds = max(1, round(seconds * 1000)) if seconds > 0 else 0
    conn.execute(f"SET lock_timeout = {milliseconds}".encode())
    if not conn.autocommit:
        conn.commit()


def _guard(exc: psycopg.Error) -> Exception:
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaNotReady(f"agentcap schema missing, run migrate(): {exc}")
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return LockWaitTimeout(f"another session holds a lock on the event log: {exc}")
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


def _events(
    conn: psycopg.Connection[Any], query: bytes, run_id: str, event_id: str | None = None
) -> list[Event]:
    params: dict[str, Any] = {"run": run_id, "start": run_start(conn, run_id)}
    if event_id is not None:
        params["event"] = _event_uuid(event_id)
    try:
        with conn.cursor(row_factory=_event_row) as cur:
            return cur.execute(query, params).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc


def _event_uuid(event_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(event_id))
    except ValueError as exc:
        raise ValueError(f"not an event id (a UUID): {event_id!r}") from exc


def run_events(conn: psycopg.Connection[Any], run_id: str) -> list[Event]:
    """All events of ``run_id`` in (agent_id, logical_seq) order; ``RunNotFound`` if unknown."""
    return _events(conn, _EVENTS, run_id)


def run_agents(conn: psycopg.Connection[Any], run_id: str) -> list[AgentRecord]:
    """Agents of ``run_id`` with their parent links; ``RunNotFound`` if unknown."""
    try:
        with conn.cursor(row_factory=class_row(AgentRecord)) as cur:
            rows = cur.execute(_AGENTS, (run_id,)).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    if not rows:
        run_start(conn, run_id)  # RunNotFound for an unknown run; a known one may have no agents
    return rows


def event(conn: psycopg.Connection[Any], run_id: str, event_id: str) -> Event:
    """The event ``event_id`` of ``run_id``; ``RunNotFound``, or ``EventNotFound``, if unknown;
    ``ValueError`` if ``event_id`` is not a UUID."""
    rows = _events(conn, _EVENT, run_id, event_id)
    if not rows:
        raise EventNotFound(run_id, event_id)
    return rows[0]


def event_parents(conn: psycopg.Connection[Any], run_id: str, event_id: str) -> list[Event]:
    """The stored causal parents of an event, in (agent_id, logical_seq) order."""
    return _events(conn, _PARENTS, run_id, event_id)


def event_children(conn: psycopg.Connection[Any], run_id: str, event_id: str) -> list[Event]:
    """The events that name ``event_id`` as a causal parent, in (agent_id, logical_seq) order."""
    return _events(conn, _CHILDREN, run_id, event_id)


def causal_past(conn: psycopg.Connection[Any], run_id: str, event_id: str) -> list[Event]:
    """Every stored event that happened before ``event_id`` (earlier events of its agent and,
    transitively, its causal parents and theirs), in (agent_id, logical_seq) order; empty for an
    unknown event of a known run."""
    return _events(conn, _PAST, run_id, event_id)


def conflicts_count(conn: psycopg.Connection[Any], run_id: str | None = None) -> int:
    """Number of recorded conflicts, overall or for one run."""
    try:
        if run_id is None:
            row = conn.execute(b"SELECT count(*) FROM agentcap.conflicts").fetchone()
        else:
            row = conn.execute(
                b"SELECT count(*) FROM agentcap.conflicts c JOIN agentcap.runs r"
                b" ON c.run_id = r.run_id AND c.run_started_at = r.started_at"
                b" WHERE r.run_id = %s",
                (run_id,),
            ).fetchone()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return int(row[0]) if row else 0


# --------------------------------------------------------------------------- the web view's reads
# Every query below is keyed by run_id first, so it stays a range scan of one run however many
# runs the log holds. Payloads are read only where a caller asks for one event (event_detail) or
# for the few fields a label needs (event_labels); a run's graph is ids, sequences and types.


@dataclass(frozen=True, slots=True)
class RunTotals:
    """One run with what the runs list shows about it.

    ``errors`` counts ``agent_error`` events and ``model_call`` events whose status is ``error``;
    ``input_tokens`` / ``output_tokens`` add up the usage the model calls recorded (numbers only).
    """

    run_id: str
    started_at: datetime | None
    attributes: dict[str, Any]
    first_wall_time: datetime | None
    last_wall_time: datetime | None
    agents: int
    events: int
    model_calls: int
    input_tokens: int
    output_tokens: int
    errors: int
    conflicts: int

    @property
    def duration_seconds(self) -> float | None:
        if self.first_wall_time is None or self.last_wall_time is None:
            return None
        return (self.last_wall_time - self.first_wall_time).total_seconds()


class GraphRow(NamedTuple):
    """An event as the run graph needs it: identity, place and causal parents, no payload."""

    event_id: str
    agent_id: str
    seq: int
    event_type: str
    causal_parent_ids: tuple[str, ...]


class ConflictRow(NamedTuple):
    """A row of ``agentcap.conflicts`` (``payload``: its JSON text, or ``None`` when not read)."""

    conflict_id: int
    detected_at: datetime
    reason: str
    existing_event_id: str | None
    event_id: str
    agent_id: str
    seq: int
    event_type: str
    wall_time: datetime
    causal_parent_ids: tuple[str, ...]
    idempotency_key: str
    trace_id: str | None
    span_id: str | None
    payload: Any = None


class RunVersion(NamedTuple):
    """Counts that change whenever rows of a run are added (the log is append-only)."""

    events: int
    agents: int
    conflicts: int


def _number(path: str) -> str:
    return (
        f"CASE WHEN jsonb_typeof(e.payload {path}) = 'number' "
        f"THEN (e.payload {path})::text::numeric END"
    )


_TOTALS_SELECT: Final = f"""
SELECT r.run_id, r.started_at, r.attributes, s.first_wall_time, s.last_wall_time,
       (SELECT count(*) FROM agentcap.agents a WHERE a.run_id = r.run_id) AS agents,
       s.events, s.model_calls, COALESCE(s.input_tokens, 0), COALESCE(s.output_tokens, 0),
       s.errors,
       (SELECT count(*) FROM agentcap.conflicts c
        WHERE c.run_id = r.run_id AND c.run_started_at = r.started_at) AS conflicts
FROM picked r
CROSS JOIN LATERAL (
    SELECT count(*) AS events,
           min(e.wall_time) AS first_wall_time,
           max(e.wall_time) AS last_wall_time,
           count(*) FILTER (WHERE e.event_type = 'model_call') AS model_calls,
           sum({_number("-> 'usage' -> 'input_tokens'")})
               FILTER (WHERE e.event_type = 'model_call') AS input_tokens,
           sum({_number("-> 'usage' -> 'output_tokens'")})
               FILTER (WHERE e.event_type = 'model_call') AS output_tokens,
           count(*) FILTER (
               WHERE e.event_type = 'agent_error'
                  OR (e.event_type = 'model_call' AND e.payload ->> 'status' = 'error')
           ) AS errors
    FROM agentcap.events e WHERE e.run_id = r.run_id AND e.run_started_at = r.started_at
) s
ORDER BY r.started_at DESC NULLS LAST, r.run_id
"""

_RUN_TOTALS_PAGE: Final = (
    """
WITH picked AS (
    SELECT run_id, started_at, attributes FROM agentcap.runs
    WHERE (%(q)s::text IS NULL
           OR strpos(lower(run_id), lower(%(q)s)) > 0
           OR strpos(lower(attributes::text), lower(%(q)s)) > 0)
      AND (NOT %(within)s
           OR run_id = ANY(%(ids)s::text[])
           OR EXISTS (SELECT 1 FROM unnest(%(prefixes)s::text[]) AS p(prefix)
                      WHERE starts_with(run_id, p.prefix)))
    ORDER BY started_at DESC NULLS LAST, run_id
    LIMIT %(limit)s OFFSET %(offset)s
)"""
    + _TOTALS_SELECT
).encode()

# Every event belongs to a stored run: the writer stores a run's row with its first events.
_RUN_TOTALS_ONE: Final = (
    """
WITH picked AS (
    SELECT run_id, started_at, attributes FROM agentcap.runs WHERE run_id = %(run)s
)"""
    + _TOTALS_SELECT
).encode()


def _totals_row(values: Sequence[Any]) -> RunTotals:
    (run, started, attributes, first, last, agents, events, calls, tin, tout, errors, conflicts) = (
        values
    )
    return RunTotals(
        run_id=run,
        started_at=started,
        attributes=attributes if isinstance(attributes, dict) else {},
        first_wall_time=first,
        last_wall_time=last,
        agents=int(agents),
        events=int(events),
        model_calls=int(calls),
        input_tokens=int(tin),
        output_tokens=int(tout),
        errors=int(errors),
        conflicts=int(conflicts),
    )


def run_totals(
    conn: psycopg.Connection[Any],
    *,
    limit: int = 100,
    offset: int = 0,
    search: str | None = None,
    within: tuple[Sequence[str], Sequence[str]] | None = None,
) -> list[RunTotals]:
    """A page of runs, newest first, with the totals of each; ``search`` keeps the runs whose id
    or attributes contain it (case-insensitive), ``within`` (run ids, run id prefixes) the runs
    that are one of the ids or start with one of the prefixes."""
    ids, prefixes = within if within is not None else ((), ())
    params = {
        "q": search or None,
        "limit": limit,
        "offset": offset,
        "within": within is not None,
        "ids": list(ids),
        "prefixes": list(prefixes),
    }
    try:
        rows = conn.execute(_RUN_TOTALS_PAGE, params).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return [_totals_row(row) for row in rows]


def run_totals_of(conn: psycopg.Connection[Any], run_id: str) -> RunTotals:
    """The totals of one run; ``RunNotFound`` if it is not stored."""
    try:
        row = conn.execute(_RUN_TOTALS_ONE, {"run": run_id}).fetchone()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    if row is None:
        raise RunNotFound(run_id)
    return _totals_row(row)


_GRAPH: Final = b"""
SELECT event_id::text, agent_id, logical_seq, event_type, causal_parent_ids::text[]
FROM agentcap.events WHERE run_id = %s AND run_started_at = %s ORDER BY agent_id, logical_seq
"""


def run_graph(conn: psycopg.Connection[Any], run_id: str) -> list[GraphRow]:
    """Every event of ``run_id`` without its payload, in (agent_id, logical_seq) order."""
    start = _start_of(conn, run_id)
    if start is None:
        return []
    try:
        rows = conn.execute(_GRAPH, (run_id, start)).fetchall()  # one fetch: iterating costs 3x
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return [
        GraphRow(event_id, agent, seq, event_type, tuple(parents))
        for event_id, agent, seq, event_type, parents in rows
    ]


def moved_events(
    conn: psycopg.Connection[Any], run_id: str, event_ids: Sequence[str]
) -> dict[str, str]:
    """For ids of ``run_id`` that name no stored event but a row kept in ``agentcap.conflicts``
    (a second record of a model call), the id of the stored event that row collided with."""
    start = _start_of(conn, run_id) if event_ids else None
    if start is None:
        return {}
    try:
        rows = conn.execute(
            b"SELECT DISTINCT ON (event_id) event_id::text, existing_event_id::text"
            b" FROM agentcap.conflicts"
            b" WHERE run_id = %s AND run_started_at = %s AND event_id = ANY(%s::uuid[])"
            b" AND existing_event_id IS NOT NULL"
            b" ORDER BY event_id, conflict_id",
            (run_id, start, list(event_ids)),
        ).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return {event_id: existing for event_id, existing in rows}


_CONFLICT_COLUMNS: Final = (
    "conflict_id, detected_at, reason, existing_event_id::text, event_id::text, agent_id,"
    " logical_seq, event_type, wall_time, causal_parent_ids::text[], idempotency_key, trace_id,"
    " span_id"
)


def _conflict_row(values: Sequence[Any]) -> ConflictRow:
    head = list(values)
    head[9] = tuple(head[9])
    return ConflictRow(*head)


def run_conflicts(
    conn: psycopg.Connection[Any], run_id: str, *, limit: int = 10_000, payloads: bool = False
) -> list[ConflictRow]:
    """The conflicts of ``run_id``, first detected first, at most ``limit``; with their payloads
    (as JSON text) if ``payloads``."""
    payload = ", payload::text" if payloads else ""
    query = (
        f"SELECT {_CONFLICT_COLUMNS}{payload} FROM agentcap.conflicts"
        " WHERE run_id = %s AND run_started_at = %s ORDER BY conflict_id LIMIT %s"
    ).encode()
    start = _start_of(conn, run_id)
    if start is None:
        return []
    try:
        rows = conn.execute(query, (run_id, start, limit)).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return [_conflict_row(row) for row in rows]


def conflict_detail(
    conn: psycopg.Connection[Any], run_id: str, conflict_id: int
) -> ConflictRow | None:
    """One conflict of ``run_id`` with its payload (as JSON text), or ``None``."""
    query = (
        f"SELECT {_CONFLICT_COLUMNS}, payload::text FROM agentcap.conflicts"
        " WHERE run_id = %s AND run_started_at = %s AND conflict_id = %s"
    ).encode()
    start = _start_of(conn, run_id)
    if start is None:
        return None
    try:
        row = conn.execute(query, (run_id, start, conflict_id)).fetchone()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return _conflict_row(row) if row else None


def event_conflicts(conn: psycopg.Connection[Any], event: Event) -> list[ConflictRow]:
    """The conflicts that collided with ``event`` (by id) or took its (agent, sequence) place,
    with their payloads (as JSON text)."""
    query = (
        f"SELECT {_CONFLICT_COLUMNS}, payload::text FROM agentcap.conflicts"
        " WHERE run_id = %s AND run_started_at = %s AND (existing_event_id = %s::uuid"
        " OR (agent_id = %s AND logical_seq = %s)) ORDER BY conflict_id LIMIT 1000"
    ).encode()
    start = _start_of(conn, event.run_id)
    if start is None:
        return []
    try:
        rows = conn.execute(
            query, (event.run_id, start, event.event_id, event.agent_id, event.seq)
        ).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return [_conflict_row(row) for row in rows]


_DETAIL: Final = b"""
SELECT event_id::text, run_id, agent_id, logical_seq, event_type, idempotency_key, wall_time,
       causal_parent_ids::text[], payload::text, trace_id, span_id
FROM agentcap.events
WHERE run_id = %s AND run_started_at = %s AND agent_id = %s AND logical_seq = %s
"""


def event_detail(
    conn: psycopg.Connection[Any], run_id: str, agent_id: str, seq: int
) -> Event | None:
    """The event at (``run_id``, ``agent_id``, ``seq``), or ``None``. Its ``payload`` is the JSON
    text PostgreSQL stores (never parsed here, so a number keeps every digit for the reader)."""
    start = _start_of(conn, run_id)
    if start is None:
        return None
    try:
        with conn.cursor(row_factory=_event_row) as cur:
            found: Event | None = cur.execute(_DETAIL, (run_id, start, agent_id, seq)).fetchone()
            return found
    except psycopg.Error as exc:
        raise _guard(exc) from exc


def _text_field(name: str) -> str:
    return f"'{name}', left(payload ->> '{name}', 160)"


# The few payload fields a one-line label uses, each cut short, so a window of labels never
# carries a large payload (a memory value, a tool result) to the caller.
_LABEL_FIELDS: Final = ", ".join(
    [
        *(
            _text_field(n)
            for n in (
                "tool",
                "invocation_id",
                "memory",
                "key",
                "op",
                "child_agent_id",
                "error_type",
                "message",
                "model",
                "status",
                "stop_reason",
                "timed_out",
                "found",
            )
        ),
        "'input_tokens', left(payload -> 'usage' ->> 'input_tokens', 24)",
        "'output_tokens', left(payload -> 'usage' ->> 'output_tokens', 24)",
        "'tool_uses', CASE WHEN jsonb_typeof(payload -> 'tool_use_ids') = 'array'"
        " THEN jsonb_array_length(payload -> 'tool_use_ids') END",
    ]
)

_LABELS: Final = f"""
SELECT agent_id, logical_seq, event_type,
       jsonb_strip_nulls(CASE WHEN jsonb_typeof(payload) = 'object'
                         THEN jsonb_build_object({_LABEL_FIELDS}) END)
FROM agentcap.events
WHERE run_id = %s AND run_started_at = %s AND logical_seq BETWEEN %s AND %s
  AND (%s::text[] IS NULL OR agent_id = ANY(%s::text[]))
""".encode()


def event_labels(
    conn: psycopg.Connection[Any],
    run_id: str,
    seq_from: int,
    seq_to: int,
    agent_ids: Sequence[str] | None = None,
) -> list[tuple[str, int, str, dict[str, Any]]]:
    """(agent_id, seq, event_type, label fields) of the events of ``run_id`` (of ``agent_ids``
    only, if given) whose sequence is within [``seq_from``, ``seq_to``]; the fields are short text
    cut from the payload. ``RunNotFound`` if the run is not stored."""
    agents = list(agent_ids) if agent_ids is not None else None
    start = run_start(conn, run_id)
    try:
        rows = conn.execute(_LABELS, (run_id, start, seq_from, seq_to, agents, agents)).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return [(agent, seq, event_type, fields or {}) for agent, seq, event_type, fields in rows]


_VERSION: Final = b"""
SELECT (SELECT count(*) FROM agentcap.events WHERE run_id = %(run)s AND run_started_at = %(start)s),
       (SELECT count(*) FROM agentcap.agents WHERE run_id = %(run)s),
       (SELECT count(*) FROM agentcap.conflicts
        WHERE run_id = %(run)s AND run_started_at = %(start)s)
"""


def run_version(conn: psycopg.Connection[Any], run_id: str) -> RunVersion:
    """Counts of a run's events, agents and conflicts: a cheap test of whether it grew.
    ``RunNotFound`` if the run is not stored."""
    start = run_start(conn, run_id)
    try:
        row = conn.execute(_VERSION, {"run": run_id, "start": start}).fetchone()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    assert row is not None
    return RunVersion(int(row[0]), int(row[1]), int(row[2]))


class EventText(NamedTuple):
    """The columns of an event the graph leaves out, with its payload as stored JSON text."""

    event_id: str
    agent_id: str
    seq: int
    wall_time: datetime
    idempotency_key: str
    trace_id: str | None
    span_id: str | None
    payload: str | None


_EVENT_TEXTS: Final = b"""
SELECT event_id::text, agent_id, logical_seq, wall_time, idempotency_key, trace_id, span_id,
       payload::text
FROM agentcap.events WHERE run_id = %s AND run_started_at = %s ORDER BY agent_id, logical_seq
"""


def run_event_texts(conn: psycopg.Connection[Any], run_id: str) -> Iterator[EventText]:
    """Every event of ``run_id`` in (agent_id, logical_seq) order with its payload as JSON text,
    streamed from a server-side cursor (a large run is never held twice in memory)."""
    start = _start_of(conn, run_id)
    if start is None:
        return
    try:
        with conn.cursor(name=f"agentcap_events_{uuid.uuid4().hex}") as cur:
            cur.itersize = 2_000
            cur.execute(_EVENT_TEXTS, (run_id, start))
            for row in cur:
                yield EventText(*row)
    except psycopg.Error as exc:
        raise _guard(exc) from exc


def conflicts_by_agent(conn: psycopg.Connection[Any], run_id: str) -> dict[str, int]:
    """Number of recorded conflicts of each agent of ``run_id`` (agents without any left out)."""
    start = _start_of(conn, run_id)
    if start is None:
        return {}
    try:
        rows = conn.execute(
            b"SELECT agent_id, count(*) FROM agentcap.conflicts"
            b" WHERE run_id = %s AND run_started_at = %s GROUP BY agent_id",
            (run_id, start),
        ).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return {str(agent): int(count) for agent, count in rows}


# Each id is looked up in the run's partition: first as a stored event (by the primary key), else
# as a record of the run kept in conflicts (among the run's conflicts, by their index on the run)
# and then the stored event it collided with (by the primary key).
_LOCATE: Final = b"""
SELECT ids.id::text, e.agent_id, e.logical_seq
FROM unnest(%(ids)s::uuid[]) AS ids(id)
CROSS JOIN LATERAL (
    SELECT x.agent_id, x.logical_seq FROM agentcap.events x
    WHERE x.run_id = %(run)s AND x.run_started_at = %(start)s AND x.event_id = ids.id
    UNION ALL
    (SELECT s.agent_id, s.logical_seq
     FROM agentcap.conflicts c
     JOIN agentcap.events s ON s.run_id = %(run)s AND s.run_started_at = %(start)s
                           AND s.event_id = c.existing_event_id
     WHERE c.run_id = %(run)s AND c.run_started_at = %(start)s AND c.event_id = ids.id
     ORDER BY c.conflict_id)
    LIMIT 1
) e
"""


def locate_events(
    conn: psycopg.Connection[Any], run_id: str, event_ids: Sequence[str]
) -> dict[str, tuple[str, int]]:
    """``(agent_id, logical_seq)`` of each id in ``event_ids`` that names a stored event of
    ``run_id``, or a record of the run kept in ``conflicts`` (then the stored event it collided
    with, as causal parent ids resolve); ids found neither way are left out. Only the run's own
    partition is read (no index serves an event id without its run, so looking for an id in
    every run would read the whole log): a parent in another run, which ``caused_by`` accepts,
    is left out like one not stored."""
    start = _start_of(conn, run_id) if event_ids else None
    if start is None:
        return {}
    try:
        rows = conn.execute(
            _LOCATE, {"ids": [_event_uuid(i) for i in event_ids], "run": run_id, "start": start}
        ).fetchall()
    except psycopg.Error as exc:
        raise _guard(exc) from exc
    return {str(event_id): (str(agent), int(seq)) for event_id, agent, seq in rows}
