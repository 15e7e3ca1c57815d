"""Reservation of logical-sequence blocks per (run, agent), exclusive across threads and processes.

``agentcap.agent_sequences.next_seq`` is a high-water mark: every sequence below it has been handed
out. A reservation is one atomic ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` that moves the
mark past the block; the row lock taken by the upsert serialises concurrent reservations. The new
block also starts above the largest ``logical_seq`` stored for the agent, so an agent resumed in a
new process (or after the mark was lost) never reuses a stored sequence.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Final

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from .errors import ConnectionFailed, SchemaNotReady, WriteFailed
from .partitions import RETENTION_BARRIER_KEY

PoolOrConn = ConnectionPool[Any] | psycopg.Connection[Any]

# The stored events of the agent are read in its run's partition only: a run without a runs row
# has no stored events (the writer stores a run's row with its first events). A run that db prune
# removed (or is removing: its start is below the retention watermark) gets a block that is not
# recorded, so it leaves no row behind: its events are refused as expired anyway. The statement
# runs under the retention barrier, taken by an earlier statement of the transaction, so it sees
# a watermark prune has moved.
_RESERVE: Final = """
WITH gone AS (
    SELECT EXISTS (SELECT 1 FROM agentcap.pruned_runs WHERE run_id = %(run)s)
        OR EXISTS (SELECT 1 FROM agentcap.runs r CROSS JOIN agentcap.log_settings l
                   WHERE r.run_id = %(run)s AND r.started_at < l.pruned_before) AS gone
),
stored AS (
    SELECT COALESCE(max(logical_seq) + 1, 0) AS next_free
    FROM agentcap.events
    WHERE run_id = %(run)s AND agent_id = %(agent)s
      AND run_started_at = (SELECT started_at FROM agentcap.runs WHERE run_id = %(run)s)
),
reserved AS (
    INSERT INTO agentcap.agent_sequences AS s (run_id, agent_id, next_seq)
    SELECT %(run)s, %(agent)s, GREATEST(%(at_least)s, stored.next_free) + %(size)s
    FROM stored, gone WHERE NOT gone.gone
    ON CONFLICT (run_id, agent_id) DO UPDATE
        SET next_seq = GREATEST(s.next_seq, %(at_least)s, (SELECT next_free FROM stored))
            + %(size)s
    RETURNING next_seq - %(size)s AS start
)
SELECT start FROM reserved
UNION ALL
SELECT %(at_least)s FROM gone WHERE gone.gone
"""

_BARRIER: Final = b"SELECT pg_advisory_xact_lock_shared(%s)"

_MAX_STORED: Final = """
SELECT max(logical_seq) FROM agentcap.events
WHERE run_id = %(run)s AND agent_id = %(agent)s
  AND run_started_at = (SELECT started_at FROM agentcap.runs WHERE run_id = %(run)s)
"""


def _connection(target: PoolOrConn) -> AbstractContextManager[psycopg.Connection[Any]]:
    if isinstance(target, ConnectionPool):
        return target.connection()
    return nullcontext(target)


def _run(target: PoolOrConn, query: str, params: dict[str, Any], *, barrier: bool = False) -> Any:
    try:
        with _connection(target) as conn, conn.transaction():
            if barrier:
                conn.execute(_BARRIER, (RETENTION_BARRIER_KEY,))
            row = conn.execute(query.encode(), params).fetchone()
    except PoolTimeout as exc:
        raise ConnectionFailed(f"no database connection available: {exc}") from exc
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaNotReady(f"agentcap schema missing, run migrate(): {exc}") from exc
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"database connection failed: {exc}") from exc
    except psycopg.Error as exc:
        raise WriteFailed(f"sequence query failed: {exc}") from exc
    return None if row is None else row[0]


def reserve_sequence_block(
    pool_or_conn: PoolOrConn, run_id: str, agent_id: str, *, at_least: int, size: int
) -> int:
    """Reserve ``[s, s + size)`` for the caller alone and return ``s``.

    ``s >= at_least``, ``s`` is above every sequence stored for the agent, and no other caller
    (thread or process) ever gets an overlapping block. Commits on its own; given a connection
    already inside a transaction it runs in a savepoint and the reservation holds the row lock
    until that transaction ends.
    """
    if size < 1:
        raise ValueError("size must be at least 1")
    if at_least < 0:
        raise ValueError("at_least must not be negative")
    params = {"run": run_id, "agent": agent_id, "at_least": at_least, "size": size}
    start = _run(pool_or_conn, _RESERVE, params, barrier=True)
    if start is None:  # pragma: no cover - one of the two branches always yields a row
        raise WriteFailed("sequence reservation returned no row")
    return int(start)


def max_stored_sequence(pool_or_conn: PoolOrConn, run_id: str, agent_id: str) -> int | None:
    """The largest ``logical_seq`` stored for the agent, or None when it has no events."""
    value = _run(pool_or_conn, _MAX_STORED, {"run": run_id, "agent": agent_id})
    return None if value is None else int(value)
