"""``EventWriter``: store a ``model.Batch`` in one transaction, deduplicated, conflicts kept.

One batch is one transaction on a pooled connection:

1. take the retention barrier (a shared advisory lock; ``db prune`` takes it exclusively while it
   moves the retention watermark, see ``retention``);
2. upsert the batch's runs (sorted; rows that would change nothing are skipped, so steady-state
   batches take no row locks there and concurrent writers do not serialise). A run's start, the
   partition key of its rows, is fixed by the first write of the run and never changed; a run
   not yet stored whose start is below the watermark, or that db prune removed, is not stored
   (its rows are "expired");
3. read each run's stored start; rows of expired runs are dropped and counted. When a start lies
   outside the partitions this writer knows (and the catalog confirms it), the transaction is
   rolled back, ``agentcap.ensure_partitions`` creates the partition in a transaction of its own,
   and the batch is written again;
4. upsert the agents of the batch's runs, as the runs, keep the records that differ from the
   stored rows in ``agentcap.record_conflicts``, and store the span envelopes, each with its run's
   start (binary COPY into this writer's span staging table, then one insert where the first
   writer wins). Agent rows this writer already stored and found equal to the stored rows are
   not sent again (``SettledAgentRows``: the log keeps the first known name and lineage, so
   sending them would change nothing);
5. binary COPY of the events, each with its run's start, into this writer's staging table
   (truncated first);
6. one statement classifies every staged row against ``agentcap.events`` (every probe names the
   run and its start, so it reads one partition) and inserts the new ones
   (``ON CONFLICT (run_id, run_started_at, event_id) DO NOTHING``, sorted by run, agent, seq) and
   the colliding ones into ``agentcap.conflicts``. Exact repeats are counted as duplicates. A
   ``model_call`` row recording an API call the log already holds under another event id (same
   run, same response id or request id) is a conflict too (``model_call_response_id`` /
   ``model_call_request_id``).

A concurrent writer may insert a colliding row between classification and insert: a unique
violation (or fewer inserted rows than classified new) rolls the transaction back and the batch is
retried, a bounded number of times, so the next classification sees that row.

A batch that the caller expects to be new (``write_prepared(..., direct=True)``: events captured
by this process and never sent before) first takes the direct path: steps 1 to 4 as above, then
the rows, each with its run's start, are copied straight into ``agentcap.events``, with no
staging and no classification. It is all or nothing: if any row collides with anything (a stored
event, a model call stored under another id, an event type the table refuses), the COPY fails,
the transaction is rolled back, and the batch goes the staging path above, which files each row
as new, duplicate or conflict. So the direct path changes the cost, never the outcome.

Only the staging path's classification needs the partitions' statistics (without them its
probes may read a whole run per row). The writer counts the rows it inserts per partition and
asks for an analyze now and then (``partitions.AnalyzeSchedule``): after a staged batch at once,
after a direct batch only at the start of its next staged batch, so a writer that only copies
straight in spends no server time on ANALYZE (autovacuum analyzes for readers).

The rows' binary COPY data (``rows.copy_data``) carries each run's start. A run's start never
changes once stored, so the writers of one exporter share the starts they have read
(``RunStartCache``) and the exporter builds the data ahead with them; the writer checks them
against the starts it reads in the transaction and builds the data again when one differs, or
when a run turned out to be expired.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg_pool import PoolTimeout

from otel_agentcap.model import EVENT_TYPES, Batch
from otel_agentcap.pipeline.call_identity import (
    BY_REQUEST_ID,
    BY_RESPONSE_ID,
    REQUEST_ID,
    RESPONSE_ID,
)
from otel_agentcap.protocols import ConnectionSource

from .connection import first_line
from .errors import (
    AgentCapStorageError,
    ConnectionFailed,
    DataRejected,
    InvalidPayload,
    LockWaitTimeout,
    SchemaNotReady,
    WriteContention,
    WriteFailed,
    WritesRefused,
)
from .partitions import (
    RETENTION_BARRIER_KEY,
    AnalyzeSchedule,
    PartitionCache,
    analyze_partitions,
    ensure_partitions,
    is_missing_partition,
)
from .rows import (
    DEFAULT_MAX_PAYLOAD_CHARS,
    EVENT_COLUMNS,
    STAGING_COLUMNS,
    AgentRow,
    DeferredRows,
    EventRow,
    PreparedBatch,
    SpanRow,
    copy_data,
    prepare,
    row_run_counts,
    row_runs,
    span_copy_data,
    span_row_runs,
)

_log = logging.getLogger(__name__)

#: Set while a thread writes a batch: a connection it lost is the writer's to report.
_writing = threading.local()


class _LostConnectionReturned(logging.Filter):
    """Drops psycopg_pool's "discarding closed connection" warning for a connection the writer
    lost while writing (it is given back to the pool in the writing thread): the writer handles
    the loss (it retries, or raises ``ConnectionFailed``), and the warning reached users' stderr
    where logging was not configured."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            getattr(_writing, "depth", 0) and record.msg == "discarding closed connection: %s"
        )


logging.getLogger("psycopg.pool").addFilter(_LostConnectionReturned())

_EVENT_COLUMNS: Final = EVENT_COLUMNS
_STAGING_NAME_RE: Final = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

_BARRIER: Final = b"SELECT pg_advisory_xact_lock_shared(%s)"

# Runs and agents: first writer wins. A new row is inserted as offered; a stored row only gets
# what it does not know yet (a run's attribute declaration, an agent's name, an agent's lineage),
# never another value (migration 0004's triggers refuse that too). Rows that would change nothing
# are filtered out first, so steady-state batches take no row locks here and concurrent writers
# do not serialise. A run's start is the partition key of its rows: a new run takes the batch's
# earliest start, else the time of its first write, and keeps it. Runs below the retention
# watermark, and runs db prune removed, are neither created nor touched.
_RUNS_UPSERT: Final = b"""
INSERT INTO agentcap.runs AS r
    (run_id, started_at, attributes, attributes_declared, trace_id, root_span_id)
SELECT v.run_id, COALESCE(v.started_at, now()), COALESCE(v.attributes, '{}'::jsonb),
       v.attributes IS NOT NULL, v.trace_id, v.root_span_id
FROM unnest(%s::text[], %s::timestamptz[], %s::jsonb[], %s::text[], %s::text[])
    AS v(run_id, started_at, attributes, trace_id, root_span_id)
CROSS JOIN agentcap.log_settings s
LEFT JOIN agentcap.runs x ON x.run_id = v.run_id
WHERE COALESCE(x.started_at, v.started_at, now()) >= s.pruned_before
  AND CASE WHEN x.run_id IS NULL
           THEN NOT EXISTS (SELECT 1 FROM agentcap.pruned_runs p WHERE p.run_id = v.run_id)
           ELSE NOT ((x.attributes_declared OR v.attributes IS NULL)
                     AND (v.trace_id IS NULL OR x.trace_id IS NOT NULL))
      END
ORDER BY v.run_id
ON CONFLICT (run_id) DO UPDATE SET
    attributes = CASE WHEN r.attributes_declared OR NOT EXCLUDED.attributes_declared
                      THEN r.attributes ELSE EXCLUDED.attributes END,
    attributes_declared = r.attributes_declared OR EXCLUDED.attributes_declared,
    trace_id = COALESCE(r.trace_id, EXCLUDED.trace_id),
    root_span_id = CASE WHEN r.trace_id IS NULL THEN EXCLUDED.root_span_id ELSE r.root_span_id END
WHERE (NOT r.attributes_declared AND EXCLUDED.attributes_declared)
   OR (r.trace_id IS NULL AND EXCLUDED.trace_id IS NOT NULL)
"""

# Span envelopes: binary COPY into the writer's span staging table, then one insert in which the
# first writer wins (a re-sent span changes nothing).
_SPAN_COLUMNS: Final = (
    ("run_id", "text"),
    ("trace_id", "text"),
    ("span_id", "text"),
    ("parent_span_id", "text"),
    ("name", "text"),
    ("kind", "int2"),
    ("start_time", "timestamptz"),
    ("end_time", "timestamptz"),
    ("status_code", "int2"),
    ("status_message", "text"),
    ("service_name", "text"),
    ("scope_name", "text"),
    ("run_started_at", "timestamptz"),
)
_SPANS_INSERT: Final = """
INSERT INTO agentcap.spans ({columns})
SELECT {columns} FROM {staging} ORDER BY run_id, trace_id, span_id
ON CONFLICT (run_id, run_started_at, trace_id, span_id) DO NOTHING
"""

# Each run's stored start, and whether the retention watermark has passed it, read after the
# upsert.
_RUN_STARTS: Final = b"""
SELECT v.run_id, r.started_at, r.started_at < s.pruned_before AS expired
FROM unnest(%s::text[]) AS v(run_id)
CROSS JOIN agentcap.log_settings s
LEFT JOIN agentcap.runs r ON r.run_id = v.run_id
"""

_AGENTS_UPSERT: Final = b"""
INSERT INTO agentcap.agents AS a
    (run_id, agent_id, name, parent_agent_id, spawned_at_event_id, lineage_known)
SELECT v.run_id, v.agent_id, v.name, v.parent_agent_id, v.spawned_at_event_id, v.lineage_known
FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::uuid[], %s::bool[])
    AS v(run_id, agent_id, name, parent_agent_id, spawned_at_event_id, lineage_known)
WHERE NOT EXISTS (
    SELECT 1 FROM agentcap.agents x
    WHERE x.run_id = v.run_id AND x.agent_id = v.agent_id
      AND (v.name IS NULL OR x.name IS NOT NULL)
      AND (NOT v.lineage_known OR x.lineage_known OR x.parent_agent_id IS NOT NULL))
ORDER BY v.run_id, v.agent_id
ON CONFLICT (run_id, agent_id) DO UPDATE SET
    name = COALESCE(a.name, EXCLUDED.name),
    parent_agent_id = CASE WHEN a.lineage_known OR a.parent_agent_id IS NOT NULL
                                OR NOT EXCLUDED.lineage_known
                           THEN a.parent_agent_id ELSE EXCLUDED.parent_agent_id END,
    spawned_at_event_id = CASE WHEN a.lineage_known OR a.parent_agent_id IS NOT NULL
                                    OR NOT EXCLUDED.lineage_known
                               THEN a.spawned_at_event_id ELSE EXCLUDED.spawned_at_event_id END,
    lineage_known = a.lineage_known OR EXCLUDED.lineage_known
WHERE (a.name IS NULL AND EXCLUDED.name IS NOT NULL)
   OR (NOT a.lineage_known AND EXCLUDED.lineage_known)
"""

# After the upserts (a separate statement, so it sees rows that concurrent writers committed
# meanwhile): every offered record that differs from the stored row goes to record_conflicts.
_RECORD_CONFLICTS: Final = b"""
WITH ra AS (
    SELECT * FROM unnest(%s::text[], %s::jsonb[]) AS v(run_id, attributes)
), ag AS (
    SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::uuid[], %s::bool[])
        AS v(run_id, agent_id, name, parent_agent_id, spawned_at_event_id, lineage_known)
), found AS (
    SELECT ra.run_id, NULL::text AS agent_id, 'run_attributes' AS reason,
           r.attributes AS stored, ra.attributes AS offered
    FROM ra JOIN agentcap.runs r ON r.run_id = ra.run_id
    WHERE r.attributes_declared AND r.attributes IS DISTINCT FROM ra.attributes
    UNION ALL
    SELECT ag.run_id, ag.agent_id, 'agent_name', to_jsonb(a.name), to_jsonb(ag.name)
    FROM ag JOIN agentcap.agents a ON a.run_id = ag.run_id AND a.agent_id = ag.agent_id
    WHERE ag.name IS NOT NULL AND a.name IS NOT NULL AND a.name <> ag.name
    UNION ALL
    SELECT ag.run_id, ag.agent_id, 'agent_lineage',
           jsonb_build_object('parent_agent_id', a.parent_agent_id,
                              'spawned_at_event_id', a.spawned_at_event_id),
           jsonb_build_object('parent_agent_id', ag.parent_agent_id,
                              'spawned_at_event_id', ag.spawned_at_event_id)
    FROM ag JOIN agentcap.agents a ON a.run_id = ag.run_id AND a.agent_id = ag.agent_id
    WHERE ag.lineage_known AND (a.lineage_known OR a.parent_agent_id IS NOT NULL)
      AND (a.parent_agent_id, a.spawned_at_event_id)
          IS DISTINCT FROM (ag.parent_agent_id, ag.spawned_at_event_id)
), ins AS (
    INSERT INTO agentcap.record_conflicts (run_id, agent_id, reason, stored, offered, row_digest)
    SELECT run_id, agent_id, reason, stored, offered, md5(offered::text) FROM found
    ORDER BY run_id, agent_id, reason
    ON CONFLICT (run_id, agent_id, reason, row_digest) DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM found
"""

_CONTENT: Final = (
    "run_id, agent_id, logical_seq, wall_time, event_type, causal_parent_ids, "
    "idempotency_key, trace_id, span_id, payload"
)

# The direct path copies envelopes straight into agentcap.spans: a span stored already makes the
# COPY fail, and the batch goes the staging path, whose insert lets the first writer win.
_DIRECT_SPANS_COPY: Final = sql.SQL("COPY agentcap.spans ({}) FROM STDIN (FORMAT BINARY)").format(
    sql.SQL(", ").join(sql.Identifier(n) for n, _ in _SPAN_COLUMNS)
)

# Each staged row is probed with index lookups (LATERAL ... LIMIT 1 and scalar subqueries keep
# the planner from hashing the whole events table, since the staging table has no statistics).
# The fast variant probes only the primary key: a new row that collides on (run, agent, seq) or
# (run, agent, key) then raises a unique violation, and the batch is retried with the full
# variant, which probes those keys too and routes such rows to agentcap.conflicts.
_FULL_PROBES: Final = """
        CASE WHEN e.event_id IS NULL AND s.batch_reason IS NULL THEN (
            SELECT x.event_id FROM agentcap.events x
            WHERE x.run_id = s.run_id AND x.agent_id = s.agent_id AND x.logical_seq = s.logical_seq
              AND x.run_started_at = s.run_started_at
              AND x.run_started_at BETWEEN %(lo)s AND %(hi)s
            LIMIT 1
        ) END AS q_id,
        CASE WHEN e.event_id IS NULL AND s.batch_reason IS NULL THEN (
            SELECT x.event_id FROM agentcap.events x
            WHERE x.run_id = s.run_id AND x.agent_id = s.agent_id
              AND x.idempotency_key = s.idempotency_key AND x.run_started_at = s.run_started_at
              AND x.run_started_at BETWEEN %(lo)s AND %(hi)s
            LIMIT 1
        ) END AS k_id
"""
_FAST_PROBES: Final = """
        NULL::uuid AS q_id,
        NULL::uuid AS k_id
"""
# Both variants probe for the same model call stored under another event id (same run, and the
# same response id, else the same request id: otel_agentcap.pipeline.call_identity, with
# migration 0002's partial unique indexes as the backstop), only for model_call rows that carry
# such an id. The WHERE clauses repeat the index predicates verbatim so the planner uses those
# indexes.
_CALL_PROBE: Final = """
        CASE WHEN e.event_id IS NULL AND s.batch_reason IS NULL AND s.event_type = 'model_call'
                  AND jsonb_typeof(s.payload -> '{key}') = 'string' THEN (
            SELECT x.event_id FROM agentcap.events x
            WHERE x.run_id = s.run_id AND x.run_started_at = s.run_started_at
              AND x.run_started_at BETWEEN %(lo)s AND %(hi)s
              AND x.event_type = 'model_call'
              AND jsonb_typeof(x.payload -> '{key}') = 'string'
              AND (x.payload ->> '{key}') = (s.payload ->> '{key}')
            LIMIT 1
        ) END AS {alias}"""
_CALL_PROBES: Final = ",".join(
    (
        _CALL_PROBE.format(key=RESPONSE_ID, alias="r_id"),
        _CALL_PROBE.format(key=REQUEST_ID, alias="t_id"),
    )
)
# Every probe of agentcap.events is also bounded by the batch's earliest and latest run start,
# given as parameters (lo, hi; see start_bounds): with them the planner keeps only the partitions
# that hold the batch's runs. The equality with each staged row's start prunes only at run time,
# so without them each of the five probes planned (and locked) an index scan of every partition,
# and planning grew with the number of partitions: 1.5 ms per batch with 4 partitions, 10 to 17
# ms with 43.
_CLASSIFY_AND_INSERT: Final = """
WITH p AS MATERIALIZED (
    SELECT s.*,
        e.event_id AS e_id,
        ({e_content}) IS NOT DISTINCT FROM ({s_content}) AS e_same,
{probes},
{call_probes}
    FROM {staging} s
    LEFT JOIN LATERAL (
        SELECT x.* FROM agentcap.events x
        WHERE x.run_id = s.run_id AND x.event_id = s.event_id
          AND x.run_started_at = s.run_started_at
          AND x.run_started_at BETWEEN %(lo)s AND %(hi)s
        LIMIT 1
    ) e ON true
),
c AS MATERIALIZED (
    SELECT p.*,
        CASE
            -- An exact copy of a stored event is a duplicate, even when an earlier row of the
            -- same batch collided with it.
            WHEN e_id IS NOT NULL AND e_same THEN 'duplicate'
            WHEN batch_reason IS NOT NULL THEN batch_reason
            WHEN event_type <> ALL ({event_types}) THEN 'invalid_event_type'
            WHEN e_id IS NOT NULL THEN CASE WHEN e_same THEN 'duplicate' ELSE 'event_id_content' END
            -- Before the (run, agent, seq) and (run, agent, key) probes, which the fast variant
            -- skips: a row's reason must not depend on the variant that classified it, or a
            -- re-sent row would be filed again under another reason.
            WHEN r_id IS NOT NULL THEN {by_response_id}
            WHEN t_id IS NOT NULL THEN {by_request_id}
            WHEN q_id IS NOT NULL THEN 'run_agent_seq'
            WHEN k_id IS NOT NULL THEN 'run_agent_key'
            ELSE 'new'
        END AS verdict,
        CASE WHEN batch_reason IS NOT NULL THEN batch_conflict_with
             ELSE COALESCE(e_id, r_id, t_id, q_id, k_id) END AS existing_event_id
    FROM p
),
ins AS (
    INSERT INTO agentcap.events ({columns})
    SELECT {columns} FROM c WHERE verdict = 'new'
    ORDER BY run_id, agent_id, logical_seq
    ON CONFLICT (run_id, run_started_at, event_id) DO NOTHING
    RETURNING 1
),
conf AS (
    INSERT INTO agentcap.conflicts (reason, existing_event_id, row_digest, {columns})
    SELECT verdict, existing_event_id,
           md5(row(event_id, run_id, agent_id, logical_seq, extract(epoch FROM wall_time),
                   event_type, causal_parent_ids, idempotency_key, trace_id, span_id, payload)::text),
           {columns}
    FROM c WHERE verdict NOT IN ('new', 'duplicate')
    ORDER BY run_id, agent_id, logical_seq
    ON CONFLICT (run_id, run_started_at, reason, existing_event_id, row_digest) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM ins),
       count(*) FILTER (WHERE verdict = 'new'),
       count(*) FILTER (WHERE verdict = 'duplicate'),
       count(*) FILTER (WHERE verdict NOT IN ('new', 'duplicate'))
FROM c
"""

_RETRYABLE_DB_ERRORS: Final = (
    psycopg.errors.UniqueViolation,
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
)


_DIRECT_COPY: Final = sql.SQL("COPY agentcap.events ({}) FROM STDIN (FORMAT BINARY)").format(
    sql.SQL(", ").join(sql.Identifier(n) for n in _EVENT_COLUMNS)
)


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What one ``EventWriter.write`` did: rows stored, repeats dropped, collisions recorded,
    records left out because they broke a validation rule (``otel_agentcap.validation``)."""

    inserted: int
    duplicates: int
    conflicts: int
    attempts: int = 1
    #: Events left out: invalid (logged with the reason).
    rejected: int = 0
    #: Agent or run records that differ from the stored rows (kept in record_conflicts).
    record_conflicts: int = 0
    #: Agent or run records left out: invalid.
    rejected_records: int = 0
    #: Events not stored because their run started before the retention watermark, or was
    #: removed by ``db prune`` (a late redelivery).
    expired: int = 0


_rejected_lock = threading.Lock()
_rejected_logged_at = 0.0


def _log_rejected(reasons: tuple[str, ...]) -> None:
    """Log records left out of a batch, at most once every 10 s (a flood of bad spans must not
    flood the log); every one is counted by the caller."""
    global _rejected_logged_at
    now = time.monotonic()
    with _rejected_lock:
        if now - _rejected_logged_at < 10:
            return
        _rejected_logged_at = now
    _log.warning(
        "agentcap: %d record(s) of a batch broke a validation rule and were left out, e.g.: %s",
        len(reasons),
        "; ".join(sorted(set(reasons))[:3]),
    )


class _ConcurrentInsert(Exception):
    """A concurrent writer stored one of our new event ids first: classify again."""


class _PartitionsMissing(Exception):
    """The batch names run starts that no partition holds: create them, then write again."""

    def __init__(self, starts: list[datetime]) -> None:
        super().__init__(f"no partition for run starts {starts}")
        self.starts = starts


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode(), usedforsecurity=False).hexdigest()[:8]


def default_staging_name() -> str:
    """``staging_<host>_<pid>_<random>``: host and pid let a later writer on the same host find
    the tables of processes that died without dropping theirs."""
    return f"staging_{_host_tag()}_{os.getpid()}_{uuid.uuid4().hex[:12]}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def orphaned_staging_tables(names: list[str]) -> list[str]:
    """The staging tables among ``names`` left by dead processes of this host (pure, testable)."""
    prefix = f"staging_{_host_tag()}_"
    orphans = []
    for name in names:
        if not name.startswith(prefix):
            continue  # another host's, or a name given by the user: not ours to judge
        pid_text = name[len(prefix) :].split("_", 1)[0]
        if (
            pid_text.isdigit()
            and int(pid_text) != os.getpid()
            and not _process_alive(int(pid_text))
        ):
            orphans.append(name)
    return orphans


class EventWriter:
    """Writes batches through ``pool``; safe to share between threads (batches of one writer
    serialise on its staging table); several writers (threads or processes) may write at once."""

    def __init__(
        self,
        pool: ConnectionSource,
        *,
        staging_name: str | None = None,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        max_payload_chars: int = DEFAULT_MAX_PAYLOAD_CHARS,
        run_starts: RunStartCache | None = None,
    ) -> None:
        name = staging_name or default_staging_name()
        if not _STAGING_NAME_RE.match(name):
            raise ValueError(f"staging table name must match {_STAGING_NAME_RE.pattern}: {name!r}")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self._pool = pool
        self._name = name
        self._max_attempts = max_attempts
        self._connect_timeout = connect_timeout
        self._max_payload_chars = max_payload_chars
        self._staging_ready = False
        self._lock = threading.Lock()
        self._partitions = PartitionCache()
        #: Starts of stored runs, shared with the exporter that builds COPY data ahead.
        self.run_starts = run_starts if run_starts is not None else RunStartCache()
        self._analyze = AnalyzeSchedule()
        #: Partitions (by their lower bound) due for an analyze that only the staging path
        #: needs (see ``_analyze_due``).
        self._analyze_pending: set[datetime] = set()
        self._agents_settled = SettledAgentRows()
        self._use_schema("agentcap")

    def _use_schema(self, schema: str) -> None:
        """Stage in ``schema``: ``agentcap`` (an UNLOGGED table) or ``pg_temp`` (a TEMP table
        per connection, for a role that may not create tables in ``agentcap``)."""
        self._temporary = schema == "pg_temp"
        self._staging = sql.Identifier(schema, self._name)
        # Within PostgreSQL's 63-byte identifiers; the prefix keeps the orphan clean-up's parse.
        self._span_staging = sql.Identifier(schema, f"{self._name[:57]}_spans")
        span_columns = sql.SQL(", ").join(sql.Identifier(n) for n, _ in _SPAN_COLUMNS)
        self._copy_spans = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
            self._span_staging, span_columns
        )
        self._insert_spans = sql.SQL(_SPANS_INSERT).format(
            columns=span_columns, staging=self._span_staging
        )
        self._classify_fast = self._build_classify(_FAST_PROBES)
        self._classify_full = self._build_classify(_FULL_PROBES)
        self._copy = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
            self._staging, sql.SQL(", ").join(sql.Identifier(n) for n, _ in STAGING_COLUMNS)
        )
        columns = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in STAGING_COLUMNS
        )
        span_typed = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in _SPAN_COLUMNS
        )
        if self._temporary:
            # Created in each transaction if missing: a TEMP table belongs to one session, and a
            # pool (or a transaction-pooling proxy) hands out several.
            create = sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} ({}); TRUNCATE {}")
            self._prepare_staging = create.format(self._staging, columns, self._staging)
            self._prepare_span_staging = create.format(
                self._span_staging, span_typed, self._span_staging
            )
        else:
            self._prepare_staging = sql.SQL("TRUNCATE {}").format(self._staging)
            self._prepare_span_staging = sql.SQL("TRUNCATE {}").format(self._span_staging)
        unlogged = sql.SQL(
            "CREATE UNLOGGED TABLE IF NOT EXISTS {} ({}) WITH (autovacuum_enabled = false)"
        )
        self._create_staging = sql.Composed(
            [
                unlogged.format(self._staging, columns),
                sql.SQL("; "),
                unlogged.format(self._span_staging, span_typed),
            ]
        )

    @property
    def staging_table(self) -> str:
        """Qualified name of this writer's staging table (``pg_temp.*`` when the role may not
        create tables in ``agentcap``)."""
        return f"{'pg_temp' if self._temporary else 'agentcap'}.{self._name}"

    def _build_classify(self, probes: str) -> sql.Composed:
        columns = sql.SQL(", ").join(sql.Identifier(c) for c in _EVENT_COLUMNS)
        types = sql.SQL("ARRAY[{}]::text[]").format(
            sql.SQL(", ").join(sql.Literal(t) for t in sorted(EVENT_TYPES))
        )
        e_content = ", ".join(f"e.{c.strip()}" for c in _CONTENT.split(","))
        s_content = ", ".join(f"s.{c.strip()}" for c in _CONTENT.split(","))
        return sql.SQL(_CLASSIFY_AND_INSERT).format(
            event_types=types,
            e_content=sql.SQL(e_content),
            s_content=sql.SQL(s_content),
            staging=self._staging,
            columns=columns,
            probes=sql.SQL(probes),
            call_probes=sql.SQL(_CALL_PROBES),
            by_response_id=sql.Literal(BY_RESPONSE_ID),
            by_request_id=sql.Literal(BY_REQUEST_ID),
        )

    def _ensure_staging(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            if self._staging_ready:
                return
            row = conn.execute("SELECT has_schema_privilege('agentcap', 'CREATE')").fetchone()
            conn.rollback()
            if row is not None and not row[0]:
                # A least-privilege writer (see `otel-agentcap db grant`): stage in a TEMP table
                # of each connection, created with the batch.
                self._use_schema("pg_temp")
                self._staging_ready = True
                return
            if self._temporary:
                self._use_schema("agentcap")
            with conn.transaction():
                conn.execute(self._create_staging)
            self._staging_ready = True
            self._drop_orphans(conn)

    def _drop_orphans(self, conn: psycopg.Connection[Any]) -> None:
        """Best effort: drop staging tables that dead processes of this host left behind, never
        waiting on a lock (a table in use is not an orphan's)."""
        try:
            rows = conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'agentcap' "
                "AND tablename LIKE 'staging\\_%'"
            ).fetchall()
            conn.rollback()
            for name in orphaned_staging_tables([str(r[0]) for r in rows]):
                with conn.transaction():
                    conn.execute("SET LOCAL lock_timeout = '100ms'")
                    conn.execute(
                        sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier("agentcap", name))
                    )
                _log.info("agentcap: dropped staging table %s left by a dead process", name)
        except psycopg.Error as exc:
            _log.debug("agentcap: staging clean-up skipped: %s", exc)
            if not conn.closed:
                conn.rollback()

    def _check_partitions(
        self, conn: psycopg.Connection[Any], starts: set[datetime], everywhere: bool
    ) -> None:
        """Raise ``_PartitionsMissing`` for starts outside the known partitions of events (all
        ``starts`` when ``everywhere``: an insert found a run-partitioned table without one)."""
        if everywhere:
            raise _PartitionsMissing(sorted(starts))
        if not self._partitions.missing(starts):
            return
        self._partitions.refresh(conn)
        missing = self._partitions.missing(starts)
        if missing:
            raise _PartitionsMissing(missing)

    def _analyze_due(
        self,
        conn: psycopg.Connection[Any],
        starts: Mapping[str, datetime],
        events: Sequence[EventRow],
        *,
        staged: bool,
    ) -> None:
        """Count the rows a committed batch inserted, and ask for the partitions this writer
        fills to be analyzed now and then (see ``partitions.AnalyzeSchedule``), after the batch
        committed. Only the staging path's classification needs the statistics (its probes name
        one event each only when the planner knows how large a run is); readers plan without
        them (autovacuum analyzes later). So a batch of the direct path (``staged`` false) only
        notes the partitions that are due, and the next batch of the staging path has them
        analyzed first (``_analyze_pending``)."""
        # Counted by run first (in C), then by partition: a partition lookup per run, not per row.
        rows_by_start: dict[datetime, int] = {}
        lower_of = self._partitions.lower_of
        for run_id, count in row_run_counts(events).items():
            lower = lower_of(starts[run_id])
            rows_by_start[lower] = rows_by_start.get(lower, 0) + count
        due = self._analyze.add(rows_by_start)
        if not staged:
            with self._lock:
                self._analyze_pending.update(due)
            return
        self._analyze_now(conn, due)

    def _analyze_pending_now(self, conn: psycopg.Connection[Any]) -> None:
        """Before a batch of the staging path: have the partitions that direct batches left due
        analyzed (best effort, in a transaction of its own)."""
        with self._lock:
            due = sorted(self._analyze_pending)
            self._analyze_pending.clear()
        self._analyze_now(conn, due)

    def _analyze_now(self, conn: psycopg.Connection[Any], due: list[datetime]) -> None:
        if not due:
            return
        try:
            analyze_partitions(conn, due)
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError) and conn.broken:
                with self._lock:  # the connection is replaced; asked again before the next one
                    self._analyze_pending.update(due)
                return
            _log.debug("agentcap: partitions not analyzed: %s", exc)

    def _open(
        self, conn: psycopg.Connection[Any], batch: PreparedBatch, everywhere: bool
    ) -> _Opened:
        """Steps 1 to 4 (see the module doc), inside the caller's transaction: the barrier, the
        runs and their stored starts, the partitions they need, the agents and the records that
        differ from the stored rows. The span envelopes are the caller's to write.

        The statements go in two pipelines (one round trip each, not one per statement): the
        barrier, the runs and their starts; then, once the starts are read, the agents and the
        records that differ. Each statement is still a statement of its own, so each sees what
        other writers committed before it started."""
        with _pipeline(conn):
            conn.execute(_BARRIER, (RETENTION_BARRIER_KEY,))
            if not batch.runs:
                return _Opened({}, [], 0, [], [], 0)
            conn.execute(_RUNS_UPSERT, [[r[i] for r in batch.runs] for i in range(5)])
            cursor = conn.execute(_RUN_STARTS, ([r[0] for r in batch.runs],))
        read: dict[str, datetime | None] = {}
        for run_id, started_at, expired in cursor:
            read[run_id] = None if started_at is None or expired else started_at
        starts = {run: start for run, start in read.items() if start is not None}
        # The runs of the rows, gathered in C; the rows are filtered only when a run is not
        # taken (expired or gone), which is rare.
        event_runs = row_runs(batch.events)
        span_runs = span_row_runs(batch.spans)
        kept = (
            batch.events
            if event_runs.issubset(starts)
            else [row for row in batch.events if row.run_id in starts]
        )
        kept_spans = (
            batch.spans
            if span_runs.issubset(starts)
            else [row for row in batch.spans if row[0] in starts]
        )
        if kept or kept_spans:
            self._check_partitions(
                conn, {starts[run] for run in event_runs | span_runs if run in starts}, everywhere
            )
        settled = self._agents_settled
        agents = [a for a in batch.agents if a[0] in starts and a not in settled]
        run_offers = [r for r in batch.run_offers if r[0] in starts]
        agent_offers = [a for a in batch.agent_offers if a[0] in starts and a not in settled]
        records: psycopg.Cursor[Any] | None = None
        if agents or run_offers or agent_offers:
            with _pipeline(conn):
                if agents:
                    conn.execute(_AGENTS_UPSERT, [[a[i] for a in agents] for i in range(6)])
                if run_offers or agent_offers:
                    # After the upserts, a statement of its own: it sees rows others committed.
                    records = conn.execute(
                        _RECORD_CONFLICTS,
                        [
                            *([r[i] for r in run_offers] for i in range(2)),
                            *([a[i] for a in agent_offers] for i in range(6)),
                        ],
                    )
        row = records.fetchone() if records is not None else None
        gone = [run for run, start in read.items() if start is None]
        return _Opened(
            starts,
            kept,
            len(batch.events) - len(kept),
            kept_spans,
            gone,
            int(row[0]) if row else 0,
            [*agents, *agent_offers],
        )

    def _write_once(
        self,
        conn: psycopg.Connection[Any],
        batch: PreparedBatch,
        data: _CopyData | None,
        span_data: _CopyData | None,
        *,
        full: bool,
        everywhere: bool,
    ) -> tuple[int, int, int, int, _Opened]:
        with conn.transaction():
            opened = self._open(conn, batch, everywhere)
            if opened.spans:
                self._write_spans(conn, opened, batch, span_data)
            records = opened.records
            if not opened.events:
                return 0, 0, 0, records, opened
            conn.execute(self._prepare_staging)
            with conn.cursor() as cur, cur.copy(self._copy) as copy:
                copy.write(
                    _usable(data, batch, opened)
                    or copy_data(opened.events, staging=True, starts=opened.starts)
                )
            row = conn.execute(
                self._classify_full if full else self._classify_fast,
                start_bounds(opened.starts[run] for run in row_runs(opened.events)),
            ).fetchone()
            assert row is not None
            inserted, new, duplicates, conflicts = (int(v) for v in row)
            if inserted != new:
                raise _ConcurrentInsert
            return inserted, duplicates, conflicts, records, opened

    def _write_spans(
        self,
        conn: psycopg.Connection[Any],
        opened: _Opened,
        batch: PreparedBatch,
        data: _CopyData | None,
    ) -> None:
        conn.execute(self._prepare_span_staging)
        with conn.cursor() as cur, cur.copy(self._copy_spans) as copy:
            copy.write(
                _usable(data, batch, opened, spans=True)
                or span_copy_data(opened.spans, starts=opened.starts)
            )
        conn.execute(self._insert_spans)

    def _write_direct(
        self,
        conn: psycopg.Connection[Any],
        batch: PreparedBatch,
        data: _CopyData | None,
        span_data: _CopyData | None,
        *,
        everywhere: bool,
    ) -> tuple[int, int, int, int, _Opened]:
        with conn.transaction():
            opened = self._open(conn, batch, everywhere)
            if opened.spans:
                with conn.cursor() as cur, cur.copy(_DIRECT_SPANS_COPY) as copy:
                    copy.write(
                        _usable(span_data, batch, opened, spans=True)
                        or span_copy_data(opened.spans, starts=opened.starts)
                    )
            records = opened.records
            if opened.events:
                with conn.cursor() as cur, cur.copy(_DIRECT_COPY) as copy:
                    copy.write(
                        _usable(data, batch, opened)
                        or copy_data(opened.events, staging=False, starts=opened.starts)
                    )
        return len(opened.events), 0, 0, records, opened

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of the pool for one attempt (see ``_LostConnectionReturned``)."""
        _writing.depth = getattr(_writing, "depth", 0) + 1
        try:
            with self._pool.connection(timeout=self._connect_timeout) as conn:
                yield conn
        finally:
            _writing.depth -= 1

    def write(self, batch: Batch, *, validated: bool = False) -> WriteResult:
        """Store ``batch`` atomically. Raises an ``AgentCapStorageError`` subclass on failure,
        after which nothing of the batch is stored and the writer remains usable.

        Every record is checked against ``otel_agentcap.validation`` first (those that break a
        rule are left out and counted), unless ``validated`` says the caller did it with the same
        rules."""
        return self.write_prepared(prepare(batch, self._max_payload_chars, validated=validated))

    def write_prepared(
        self,
        prepared: PreparedBatch,
        *,
        direct: bool = False,
        data: bytes | None = None,
        span_data: bytes | None = None,
        starts: Mapping[str, datetime] | None = None,
    ) -> WriteResult:
        """Store a prepared batch atomically (see :meth:`write`). With ``direct`` the rows are
        first copied straight into the events table (see the module doc); the outcome is the
        same, only cheaper when no row collides. ``data`` is the rows' COPY data
        (``rows.copy_data``) for the path ``direct`` names, and ``span_data`` the span envelopes'
        (``rows.span_copy_data``, either path), when the caller built them already, both with
        the run ``starts`` given (from ``run_starts``); they are used only when every run of the
        batch has that start and none is expired."""
        last: Exception | None = None
        full = False
        everywhere = False
        create: list[datetime] = []
        known = dict(starts) if starts is not None else None
        # ``data`` is for the path the caller asked for, whichever this batch can take.
        staging_data = _CopyData(data, known) if data is not None and not direct else None
        direct = direct and _direct_candidate(prepared.events)
        direct_data = _CopyData(data, known) if data is not None and direct else None
        spans = _CopyData(span_data, known) if span_data is not None else None
        for attempt in range(1, self._max_attempts + 1):
            try:
                with self._connection() as conn:
                    if create:
                        ensure_partitions(conn, create)
                        create = []
                        self._partitions.refresh(conn)
                        conn.rollback()
                    if direct:
                        inserted, duplicates, conflicts, records, opened = self._write_direct(
                            conn, prepared, direct_data, spans, everywhere=everywhere
                        )
                    else:
                        if not self._staging_ready:
                            self._ensure_staging(conn)
                        if self._analyze_pending:
                            self._analyze_pending_now(conn)
                        inserted, duplicates, conflicts, records, opened = self._write_once(
                            conn, prepared, staging_data, spans, full=full, everywhere=everywhere
                        )
                    if inserted:
                        self._analyze_due(conn, opened.starts, opened.events, staged=not direct)
            except _PartitionsMissing as exc:
                last = exc
                create = exc.starts
                everywhere = False
                continue
            except psycopg.errors.LockNotAvailable as exc:
                # The lock_timeout of the connection (``Database(lock_timeout=...)``, the role's)
                # ran out while another session held a lock on the log: trying again at once
                # would wait as long again, so the caller decides (the exporter retries later,
                # the ingest answers "retry later", import gives up).
                raise LockWaitTimeout(
                    f"batch not stored: another session holds a lock on the event log "
                    f"({first_line(exc)})"
                ) from exc
            except (_ConcurrentInsert, *_RETRYABLE_DB_ERRORS) as exc:
                last = exc
                if direct and isinstance(exc, psycopg.errors.UniqueViolation):
                    direct = False  # something in the batch collides: classify row by row
                    full = True
                    continue
                if isinstance(exc, psycopg.errors.UniqueViolation) and not full:
                    full = True  # a collision on (run, agent, seq|key): classify with all probes
                    continue
                time.sleep(min(0.005 * 2**attempt, 0.2))
                continue
            except psycopg.errors.CheckViolation as exc:
                if is_missing_partition(exc):
                    # A partition this writer knew was dropped by db prune (the next attempt
                    # reads the watermark again), or a run-partitioned table lacks one: create
                    # them all.
                    last = exc
                    self._partitions.clear()
                    everywhere = True
                    continue
                if not direct:
                    raise DataRejected(f"batch rejected and rolled back: {exc}") from exc
                direct = False  # a CHECK the staging path files as a conflict instead
                full = True
                last = exc
                continue
            except psycopg.errors.UndefinedTable as exc:
                if self._name not in str(exc):
                    raise SchemaNotReady(f"agentcap schema missing, run migrate(): {exc}") from exc
                self._staging_ready = False  # dropped behind our back: create it again
                last = exc
                continue
            except PoolTimeout as exc:
                raise ConnectionFailed(
                    f"no database connection within {self._connect_timeout}s: {exc}"
                ) from exc
            except psycopg.errors.StatementTooComplex as exc:
                # "stack depth limit exceeded": JSON nested deeper than the server parses. An
                # OperationalError by SQLSTATE class, but a payload is the problem: retrying
                # cannot help, parsing the payloads again (made safe) can.
                raise InvalidPayload(f"batch rejected and rolled back: {exc}") from exc
            except psycopg.errors.ProgramLimitExceeded as exc:
                # An OperationalError by SQLSTATE class, but the rows are the problem (an index
                # entry over its size limit), not the connection: retrying cannot help.
                raise DataRejected(f"batch rejected and rolled back: {exc}") from exc
            except psycopg.OperationalError as exc:
                last = exc  # broken connection: the pool discards it, the next attempt gets another
                time.sleep(min(0.05 * 2**attempt, 1.0))
                continue
            except psycopg.errors.InvalidTextRepresentation as exc:
                raise InvalidPayload(f"batch rejected and rolled back: {exc}") from exc
            except psycopg.errors.IntegrityError as exc:
                if not direct:
                    raise DataRejected(f"batch rejected and rolled back: {exc}") from exc
                direct = False  # e.g. a NOT NULL the staging path files as a conflict instead
                full = True
                last = exc
                continue
            except psycopg.DataError as exc:
                raise DataRejected(f"batch rejected and rolled back: {exc}") from exc
            except (
                psycopg.errors.ReadOnlySqlTransaction,
                psycopg.errors.InsufficientPrivilege,
            ) as exc:
                # Not the rows: the server or the role takes no writes now (a standby, a role
                # without the writer's privileges). The batch waits, as for a server that is
                # down; splitting it would refuse every span for good.
                raise WritesRefused(f"batch not stored: {first_line(exc)}") from exc
            except psycopg.Error as exc:
                raise WriteFailed(f"batch rejected and rolled back: {exc}") from exc
            # Committed: these starts are stored for good, and expired runs stay expired.
            self.run_starts.update(opened.starts)
            self.run_starts.forget(opened.gone)
            self._agents_settled.update(opened, conflicts=records)
            expired = opened.expired
            if conflicts:
                _log.warning(
                    "agentcap: %d event(s) collided with stored events; kept in agentcap.conflicts",
                    conflicts,
                )
            if records:
                _log.warning(
                    "agentcap: %d agent or run record(s) differ from the stored rows, which are "
                    "kept (first writer wins); the differences are in agentcap.record_conflicts",
                    records,
                )
            if expired:
                _log.warning(
                    "agentcap: %d event(s) of runs started before the retention watermark, or "
                    "removed by otel-agentcap db prune, were not stored",
                    expired,
                )
            if prepared.rejected:
                _log_rejected(prepared.rejected)
            return WriteResult(
                inserted,
                duplicates + prepared.in_batch_duplicates,
                conflicts,
                attempt,
                rejected=prepared.events_rejected,
                record_conflicts=records,
                rejected_records=len(prepared.rejected) - prepared.events_rejected,
                expired=expired,
            )
        if isinstance(last, psycopg.OperationalError):
            raise ConnectionFailed(
                f"batch not written after {self._max_attempts} attempts: {last}"
            ) from last
        raise WriteContention(
            f"batch not written after {self._max_attempts} attempts: {last!r}"
        ) from last

    def close(self) -> None:
        """Drop this writer's staging table, if it made one (best effort)."""
        if not self._staging_ready:
            return
        try:
            with self._pool.connection(timeout=self._connect_timeout) as conn:
                conn.execute(
                    sql.SQL("DROP TABLE IF EXISTS {}, {}").format(self._staging, self._span_staging)
                )
                conn.commit()
        except (psycopg.Error, PoolTimeout, AgentCapStorageError) as exc:
            _log.info("agentcap: could not drop staging table %s: %s", self.staging_table, exc)
        self._staging_ready = False


@dataclass(frozen=True, slots=True)
class _Opened:
    """What steps 1 to 4 found: the start of every run the log takes, the rows of those runs,
    how many events were left out as expired, the span envelopes of those runs, and the runs it
    does not take."""

    starts: dict[str, datetime]
    events: Sequence[EventRow]
    expired: int
    spans: Sequence[SpanRow]
    #: Runs of the batch the log does not take.
    gone: list[str]
    #: Run and agent records of the batch that differ from the stored rows (now filed).
    records: int
    #: The agent rows and agent records sent to be stored and compared with the stored rows.
    agent_rows: list[AgentRow] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _CopyData:
    """COPY data a caller built ahead, and the run starts it was built with."""

    data: bytes
    starts: dict[str, datetime] | None


def _usable(
    prebuilt: _CopyData | None, batch: PreparedBatch, opened: _Opened, *, spans: bool = False
) -> bytes | None:
    """The prebuilt data when it holds exactly the rows to write with the starts the transaction
    read: nothing left out as expired, and every run's start the same."""
    if prebuilt is None or prebuilt.starts is None:
        return None
    if len(opened.spans if spans else opened.events) != len(batch.spans if spans else batch.events):
        return None
    runs = span_row_runs(batch.spans) if spans else row_runs(batch.events)
    if any(prebuilt.starts.get(run) != opened.starts.get(run) for run in runs):
        return None
    return prebuilt.data


def start_bounds(starts: Iterable[datetime]) -> dict[str, datetime]:
    """The parameters of the classifying statement: the earliest and latest run start of the
    staged rows (not empty)."""
    values = list(starts)
    return {"lo": min(values), "hi": max(values)}


_PIPELINES: Final = psycopg.Pipeline.is_supported()


def _pipeline(conn: psycopg.Connection[Any]) -> contextlib.AbstractContextManager[object]:
    """``conn.pipeline()``, where the libpq supports it (14 and later); else the statements go
    one by one, with the same results."""
    return _quiet_pipeline(conn) if _PIPELINES else contextlib.nullcontext()


@contextlib.contextmanager
def _quiet_pipeline(conn: psycopg.Connection[Any]) -> Iterator[object]:
    """``conn.pipeline()``, left without psycopg's warning when its block raised. Leaving a
    pipeline syncs it; after a statement failed, or the connection was lost, that fails too, and
    psycopg logs the second error ("error ignored terminating <Pipeline>: the connection is
    lost"), which reached users' stderr where logging was not configured, though the writer
    handles the first one (it retries, or raises it classified). So the pipeline is left here as
    if the block had ended, and the error of leaving it is dropped for the block's own."""
    pipeline = conn.pipeline()
    pipeline.__enter__()
    try:
        yield pipeline
    except BaseException:
        with contextlib.suppress(Exception):
            pipeline.__exit__(None, None, None)
        raise
    pipeline.__exit__(None, None, None)


def _direct_candidate(rows: Sequence[EventRow]) -> bool:
    """Whether the direct path can store ``rows`` as they are: no row collides with another row
    of the batch, and every event type is one the table takes (known without reading the rows
    for ``DeferredRows`` that say so)."""
    if type(rows) is DeferredRows and rows.direct_candidate:
        return True
    return all(r.batch_reason is None and r.event_type in EVENT_TYPES for r in rows)


class SettledAgentRows:
    """Agent rows and records this writer stored and found equal to the stored rows, in a
    committed transaction. Sending one again would change nothing (the log keeps the first known
    name and lineage, and an equal record files no conflict), so ``_open`` leaves them out: a
    batch of agents the writer has met before skips the agents statements (a round trip).
    Forgotten with their runs once a run is gone (pruned); bounded (cleared when full).
    Thread-safe."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._rows: set[AgentRow] = set()
        self._capacity = capacity
        self._lock = threading.Lock()

    def __contains__(self, row: object) -> bool:
        return row in self._rows

    def update(self, opened: _Opened, *, conflicts: int) -> None:
        """After the commit of a batch that ``opened`` describes: its agent rows are settled,
        unless some record of the batch differed from the stored rows (which ones the count does
        not say, so none is remembered)."""
        with self._lock:
            if opened.gone:
                gone = set(opened.gone)
                self._rows = {row for row in self._rows if row[0] not in gone}
            if conflicts or not opened.agent_rows:
                return
            if len(self._rows) + len(opened.agent_rows) > self._capacity:
                self._rows = set()
            self._rows.update(opened.agent_rows)


class RunStartCache:
    """Run starts read from ``agentcap.runs`` and committed, shared by the writers of one
    exporter (a start never changes once stored), so the exporter can build COPY data ahead.
    Bounded: the least recently stored runs are forgotten first. Thread-safe."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._starts: OrderedDict[str, datetime] = OrderedDict()
        self._lock = threading.Lock()

    def update(self, starts: Mapping[str, datetime]) -> None:
        with self._lock:
            for run_id, start in starts.items():
                self._starts[run_id] = start
                self._starts.move_to_end(run_id)
            while len(self._starts) > self._capacity:
                self._starts.popitem(last=False)

    def forget(self, run_ids: Iterable[str]) -> None:
        with self._lock:
            for run_id in run_ids:
                self._starts.pop(run_id, None)

    def start(self, run_id: str) -> datetime | None:
        """The start of ``run_id``, or None when it is not known."""
        with self._lock:
            return self._starts.get(run_id)

    def known(self, run_ids: Iterable[str]) -> dict[str, datetime] | None:
        """The starts of all ``run_ids``, or None when one is not known."""
        with self._lock:
            found = {}
            for run_id in run_ids:
                start = self._starts.get(run_id)
                if start is None:
                    return None
                found[run_id] = start
            return found


__all__ = [
    "AgentCapStorageError",
    "ConnectionSource",
    "EventWriter",
    "RunStartCache",
    "WriteResult",
    "default_staging_name",
]
