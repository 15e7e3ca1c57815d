"""Retention: ``prune`` removes whole runs that started before a date, a partition at a time.

1. The cut is the latest partition bound at or before the date that no partition of any
   run-partitioned table straddles, so every run started before it lies wholly in partitions that
   end at or before it (a run is in the partition of its start, whatever the time of its events).
2. ``agentcap.log_settings.pruned_before`` moves to the cut, under the retention barrier that
   every write transaction holds shared (taken exclusively, first) and the partition lock
   (second): once it has moved, no write transaction that read the earlier value is still
   running, and later ones refuse rows of runs started before it (counted as expired), so no
   partition below it is created again.
3. Each partition below the cut is detached with ``DETACH PARTITION ... CONCURRENTLY`` (the parent
   stays open to readers and writers; a detach left pending by an interrupted prune is finalized)
   and dropped.
4. The rows of the pruned runs in the tables that are not partitioned by run start (``agents``,
   ``agent_sequences``, any other table of the schema with a ``run_id`` column) are deleted a
   thousand runs per transaction, then the runs rows themselves, last, so an interrupted prune
   leaves runs rows behind (never rows without a run) and running it again finishes the job. Each
   removed run leaves its id and start in ``agentcap.pruned_runs``: writers refuse to store it
   again, so a late redelivery of its spans (whatever their times) cannot make a fragment of it
   into a new run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg import sql

from .partitions import (
    PARTITIONS_LOCK_KEY,
    RETENTION_BARRIER_KEY,
    LogPartition,
    list_partitions,
    read_settings,
)

#: Runs deleted per transaction in step 4.
RUNS_PER_TRANSACTION: Final = 1000

_PER_RUN_TABLES: Final = b"""
SELECT quote_ident(c.relname)
FROM pg_class c
WHERE c.relnamespace = 'agentcap'::regnamespace AND c.relkind = 'r' AND NOT c.relispartition
  AND c.relname NOT IN ('runs', 'pruned_runs') AND c.relname NOT LIKE 'staging\\_%'
  AND EXISTS (SELECT 1 FROM pg_attribute a
              WHERE a.attrelid = c.oid AND a.attname = 'run_id' AND NOT a.attisdropped)
ORDER BY c.relname
"""

_HAS_DEFAULT: Final = b"""
SELECT partdefid <> 0 FROM pg_partitioned_table WHERE partrelid = %s::regclass
"""


@dataclass(frozen=True, slots=True)
class DroppedPartition:
    """A partition ``prune`` detached and dropped, and how long that took."""

    table: str
    partition: str
    lower: datetime
    upper: datetime
    seconds: float


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What ``prune`` did (or, with ``dry_run``, would do)."""

    before: datetime
    #: Runs started before this are gone (the retention watermark); None when nothing was
    #: ever pruned and no partition ends at or before ``before``.
    pruned_before: datetime | None
    partitions: list[DroppedPartition] = field(default_factory=list)
    runs: int = 0
    #: Rows deleted per table that is not partitioned by run start (runs included).
    rows: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False


def prune_cut(partitions: list[LogPartition], before: datetime) -> datetime | None:
    """The latest partition upper bound at or before ``before`` that no partition straddles."""
    for candidate in sorted({p.upper for p in partitions if p.upper <= before}, reverse=True):
        if not any(p.lower < candidate < p.upper for p in partitions):
            return candidate
    return None


def _move_watermark(conn: psycopg.Connection[Any], cut: datetime) -> datetime:
    with conn.transaction():
        # The barrier first, then the partition lock: the order of a write transaction that holds
        # the barrier shared and creates a partition (memory_write's first event of a run), so
        # the two can only wait for each other, never deadlock.
        conn.execute(b"SELECT pg_advisory_xact_lock(%s)", (RETENTION_BARRIER_KEY,))
        conn.execute(b"SELECT pg_advisory_xact_lock(%s)", (PARTITIONS_LOCK_KEY,))
        row = conn.execute(
            b"UPDATE agentcap.log_settings SET pruned_before = greatest(pruned_before, %s)"
            b" RETURNING pruned_before",
            (cut,),
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _drop(conn: psycopg.Connection[Any], part: LogPartition) -> DroppedPartition:
    started = time.monotonic()
    parent = sql.SQL(part.table)  # regclass text from the catalog, already quoted
    child = sql.SQL(part.partition)
    if part.detach_pending:
        conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {} FINALIZE").format(parent, child))
    else:
        row = conn.execute(_HAS_DEFAULT, (part.table,)).fetchone()
        # CONCURRENTLY is refused next to a default partition (agentcap never makes one).
        mode = sql.SQL("") if row and row[0] else sql.SQL(" CONCURRENTLY")
        conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}{}").format(parent, child, mode))
    conn.execute(sql.SQL("DROP TABLE {}").format(child))
    return DroppedPartition(
        part.table, part.partition, part.lower, part.upper, time.monotonic() - started
    )


def _delete_runs(conn: psycopg.Connection[Any], cut: datetime, rows: dict[str, int]) -> int:
    tables = [str(r[0]) for r in conn.execute(_PER_RUN_TABLES).fetchall()]
    total = 0
    while True:
        with conn.transaction():
            ids = [
                str(r[0])
                for r in conn.execute(
                    b"SELECT run_id FROM agentcap.runs WHERE started_at < %s LIMIT %s",
                    (cut, RUNS_PER_TRANSACTION),
                )
            ]
            if not ids:
                return total
            for table in tables:
                deleted = conn.execute(
                    sql.SQL("DELETE FROM agentcap.{} WHERE run_id = ANY(%s)").format(
                        sql.SQL(table)
                    ),
                    (ids,),
                ).rowcount
                rows[table] = rows.get(table, 0) + max(deleted, 0)
            conn.execute(
                b"INSERT INTO agentcap.pruned_runs (run_id, started_at)"
                b" SELECT run_id, started_at FROM agentcap.runs WHERE run_id = ANY(%s)"
                b" ON CONFLICT (run_id) DO NOTHING",
                (ids,),
            )
            deleted = conn.execute(
                b"DELETE FROM agentcap.runs WHERE run_id = ANY(%s)", (ids,)
            ).rowcount
            rows["runs"] = rows.get("runs", 0) + max(deleted, 0)
            total += len(ids)


def prune(conn: psycopg.Connection[Any], before: datetime, *, dry_run: bool = False) -> PruneResult:
    """Remove every run that started before the partition bound ``prune_cut`` finds at or before
    ``before`` (which may not be in the future), without blocking writers. ``conn`` must be in
    autocommit mode (DETACH ... CONCURRENTLY cannot run inside a transaction block). Safe to run
    again after an interruption, and alongside writers; two prunes at once serialise on the
    partition lock."""
    if before.tzinfo is None:
        raise ValueError("before must be timezone-aware")
    if not conn.autocommit:
        raise ValueError("prune needs a connection in autocommit mode")
    row = conn.execute(b"SELECT now()").fetchone()
    if row is not None and before > row[0]:
        # It would stop every run that started before it, the ones being written now included.
        raise ValueError(f"{before.isoformat()} is in the future: prune removes past runs only")
    partitions = list_partitions(conn)
    watermark = read_settings(conn).pruned_before
    cut = prune_cut(partitions, before)
    if watermark is not None and (cut is None or watermark > cut):
        cut = watermark  # finish what an earlier prune started
    if cut is None:
        return PruneResult(before, None, dry_run=dry_run)
    if dry_run:
        row = conn.execute(
            b"SELECT count(*) FROM agentcap.runs WHERE started_at < %s", (cut,)
        ).fetchone()
        planned = [
            DroppedPartition(p.table, p.partition, p.lower, p.upper, 0.0)
            for p in partitions
            if p.upper <= cut
        ]
        return PruneResult(before, cut, planned, int(row[0]) if row else 0, dry_run=True)
    cut = _move_watermark(conn, cut)
    # Listed again under the new watermark: no partition below it can appear any more.
    doomed = sorted(
        (p for p in list_partitions(conn) if p.upper <= cut), key=lambda p: (p.lower, p.table)
    )
    dropped = [_drop(conn, p) for p in doomed]
    rows: dict[str, int] = {}
    runs = _delete_runs(conn, cut, rows)
    return PruneResult(before, cut, dropped, runs, rows)


__all__ = ["DroppedPartition", "PruneResult", "prune", "prune_cut"]
