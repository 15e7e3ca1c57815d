"""Partitions of the event log by run start (migration 0006): listing, creating, the writers' cache.

``agentcap.events``, ``agentcap.conflicts`` and ``agentcap.spans`` (every table of the schema
partitioned by range of ``run_started_at``) hold each run in the partition of its start,
``agentcap.runs.started_at``, which the first write of the run fixes. Partitions are created by the SQL function
``agentcap.ensure_partitions`` (SECURITY DEFINER, so writer roles need no CREATE privilege): by the
writer when a batch names a run whose start no partition covers, by the exporter ahead of time at
start-up, by ``otel-agentcap db partitions``, and by the migration for a log it converts. There is
no default partition: with one, attaching a partition would scan it under an exclusive lock, and
``DETACH ... CONCURRENTLY`` (used by ``db prune``) would be refused.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg import sql

#: The table whose partitions the writers' cache follows (every run-partitioned table gets the
#: same ranges from ``ensure_partitions``; a missing one is created on the write that needs it).
EVENTS_TABLE: Final = "agentcap.events"

#: Transaction-level advisory lock that ``ensure_partitions`` and a change of ``pruned_before``
#: take ("agcap_pt").
PARTITIONS_LOCK_KEY: Final = 0x61676361705F7074

#: Advisory lock every write transaction holds shared from its first statement, and ``db prune``
#: exclusively while it moves ``pruned_before`` ("agcap_rt"): once prune has moved it, no write
#: transaction that read the earlier value is still running.
RETENTION_BARRIER_KEY: Final = 0x61676361705F7274

_INTERVAL_RE: Final = re.compile(
    r"^\s*(\d+)\s*(month|months|mon|week|weeks|day|days|hour|hours)\s*$", re.IGNORECASE
)


@dataclass(frozen=True, slots=True)
class LogPartition:
    """One partition of a run-partitioned table: runs started in ``[lower, upper)``."""

    table: str
    partition: str
    lower: datetime
    upper: datetime
    detach_pending: bool = False


@dataclass(frozen=True, slots=True)
class LogSettings:
    """``agentcap.log_settings``: the width of new partitions, and the retention watermark
    (writes of runs started before ``pruned_before`` are refused)."""

    partition_interval: str
    pruned_before: datetime | None


def parse_interval(text: str) -> str:
    """A partition interval as PostgreSQL reads it (``'1 month'``, ``'7 days'``, ``'6 hours'``);
    raises ``ValueError`` for anything else (the table's CHECK constraint is the final word)."""
    match = _INTERVAL_RE.match(text)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(
            f"partition interval must be a number of months, weeks, days or hours: {text!r}"
        )
    return f"{int(match.group(1))} {match.group(2).lower()}"


def run_partitioned_tables(conn: psycopg.Connection[Any]) -> list[str]:
    """The tables of the schema partitioned by ``run_started_at``, qualified."""
    rows = conn.execute(b"SELECT t::text FROM agentcap.run_partitioned_tables() t").fetchall()
    return [_qualified(str(r[0])) for r in rows]


def _qualified(name: str) -> str:
    return name if "." in name else f"agentcap.{name}"


def list_partitions(
    conn: psycopg.Connection[Any], tables: Sequence[str] | None = None
) -> list[LogPartition]:
    """The partitions of ``tables`` (default: every run-partitioned table), by table and lower bound.
    A default partition, if someone made one, is left out (it has no range)."""
    names = list(tables) if tables is not None else run_partitioned_tables(conn)
    out: list[LogPartition] = []
    for table in names:
        rows = conn.execute(
            b"SELECT partition::text, lower, upper, detach_pending"
            b" FROM agentcap.log_partitions(%s::regclass) WHERE lower IS NOT NULL",
            (table,),
        ).fetchall()
        out.extend(
            LogPartition(table, _qualified(str(p)), lo, hi, bool(pending))
            for p, lo, hi, pending in rows
        )
    return out


@dataclass(frozen=True, slots=True)
class PartitionSummary:
    """One range of the log: its partitions (one per run-partitioned table), the planner's
    estimate of the events they hold (-1 before the partition was first analyzed), and their
    size on disk with indexes and TOAST."""

    lower: datetime
    upper: datetime
    partitions: tuple[str, ...]
    events_estimate: int
    total_bytes: int
    detach_pending: bool


def summarize(conn: psycopg.Connection[Any]) -> list[PartitionSummary]:
    """The log's partitions by range, oldest first."""
    by_range: dict[tuple[datetime, datetime], list[LogPartition]] = {}
    for part in list_partitions(conn):
        by_range.setdefault((part.lower, part.upper), []).append(part)
    out = []
    for (lower, upper), parts in sorted(by_range.items()):
        names = [p.partition for p in parts]
        row = conn.execute(
            b"SELECT COALESCE(sum(pg_total_relation_size(n::regclass)), 0),"
            b" COALESCE(sum(c.reltuples) FILTER (WHERE i.inhparent = %s::regclass), -1)"
            b" FROM unnest(%s::text[]) n JOIN pg_class c ON c.oid = n::regclass"
            b" JOIN pg_inherits i ON i.inhrelid = c.oid",
            (EVENTS_TABLE, names),
        ).fetchone()
        size, events = (int(row[0]), int(row[1])) if row else (0, 0)
        out.append(
            PartitionSummary(
                lower, upper, tuple(names), events, size, any(p.detach_pending for p in parts)
            )
        )
    return out


def read_settings(conn: psycopg.Connection[Any]) -> LogSettings:
    row = conn.execute(
        b"SELECT partition_interval::text, NULLIF(pruned_before, '-infinity')"
        b" FROM agentcap.log_settings"
    ).fetchone()
    if row is None:  # pragma: no cover - the migration inserts the row
        raise LookupError("agentcap.log_settings has no row")
    return LogSettings(str(row[0]), row[1])


def set_partition_interval(conn: psycopg.Connection[Any], interval: str) -> None:
    """Width of partitions created from now on (existing ones keep theirs; a new one is narrowed
    to fit between its neighbours). Commits."""
    with conn.transaction():
        conn.execute(
            b"UPDATE agentcap.log_settings SET partition_interval = %s::interval",
            (parse_interval(interval),),
        )


def ensure_partitions(conn: psycopg.Connection[Any], starts: Iterable[datetime]) -> int:
    """Create the partitions that hold runs started at ``starts`` where missing (starts below the
    retention watermark are skipped). Runs in its own transaction; returns how many it created."""
    values = sorted(set(starts))
    if not values:
        return 0
    with conn.transaction():
        row = conn.execute(
            b"SELECT agentcap.ensure_partitions(%s::timestamptz[])", (values,)
        ).fetchone()
    return int(row[0]) if row else 0


def ensure_ahead(
    conn: psycopg.Connection[Any], ahead: int, *, lock_timeout: float | None = None
) -> int:
    """Create the partitions for runs starting now and in each of the next ``ahead`` intervals
    (waiting at most ``lock_timeout`` seconds for a lock, when given)."""
    if ahead < 0:
        raise ValueError("ahead must not be negative")
    with conn.transaction():
        if lock_timeout is not None:
            conn.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{max(1, int(lock_timeout * 1000))}ms")
                )
            )
        row = conn.execute(
            b"SELECT agentcap.ensure_partitions(ARRAY("
            b" SELECT now() + s.partition_interval * n FROM generate_series(0, %s) n))"
            b" FROM agentcap.log_settings s",
            (ahead,),
        ).fetchone()
    return int(row[0]) if row else 0


class PartitionCache:
    """The ranges of ``agentcap.events`` a writer knows to exist, so a batch only asks the
    catalog when it names a run start outside them. Stale entries (a range ``db prune`` dropped)
    cost one failed insert, after which the writer refreshes it."""

    def __init__(self) -> None:
        self._lowers: list[datetime] = []
        self._uppers: list[datetime] = []

    def covers(self, start: datetime) -> bool:
        i = bisect.bisect_right(self._lowers, start) - 1
        return i >= 0 and start < self._uppers[i]

    def lower_of(self, start: datetime) -> datetime:
        """The lower bound of the known range that holds runs started at ``start`` (``start``
        itself when none is known): one key per partition, for counting what a writer fills."""
        i = bisect.bisect_right(self._lowers, start) - 1
        return self._lowers[i] if i >= 0 and start < self._uppers[i] else start

    def missing(self, starts: Iterable[datetime]) -> list[datetime]:
        return sorted({s for s in starts if not self.covers(s)})

    def refresh(self, conn: psycopg.Connection[Any]) -> None:
        parts = [p for p in list_partitions(conn, [EVENTS_TABLE]) if not p.detach_pending]
        parts.sort(key=lambda p: p.lower)
        self._lowers = [p.lower for p in parts]
        self._uppers = [p.upper for p in parts]

    def clear(self) -> None:
        self._lowers = []
        self._uppers = []


#: Rows a writer inserts into a partition before it asks for the partition to be analyzed the
#: first time; each later ask waits for twice as many (up to ``ANALYZE_CHECK_MAX``).
ANALYZE_CHECK_FIRST: Final = 1_000
ANALYZE_CHECK_MAX: Final = 1_000_000


class AnalyzeSchedule:
    """When a writer asks ``agentcap.analyze_partitions`` about the partitions it fills: after
    ``ANALYZE_CHECK_FIRST`` rows of a partition (the writer counts by ``PartitionCache.lower_of``,
    so a partition filled by many small runs is asked about as one filled by one large run),
    then after twice as many each time, so the asks cost nothing next to the rows (the function
    analyzes only partitions that have grown past what their last analyze saw)."""

    def __init__(self) -> None:
        self._counts: dict[datetime, int] = {}
        self._next: dict[datetime, int] = {}
        self._lock = threading.Lock()

    def add(self, rows_by_start: dict[datetime, int]) -> list[datetime]:
        """Count inserted rows per partition (by a run start in it, its lower bound say); the
        keys whose partitions are due for an ask."""
        with self._lock:
            return self._add(rows_by_start)

    def _add(self, rows_by_start: dict[datetime, int]) -> list[datetime]:
        due = []
        for start, rows in rows_by_start.items():
            count = self._counts.get(start, 0) + rows
            self._counts[start] = count
            threshold = self._next.get(start, ANALYZE_CHECK_FIRST)
            if count >= threshold:
                due.append(start)
                self._next[start] = min(count + max(threshold, count), count + ANALYZE_CHECK_MAX)
        if len(self._counts) > 10_000:  # partitions (or starts) of the past: start afresh
            self._counts.clear()
            self._next.clear()
        return due


def analyze_partitions(conn: psycopg.Connection[Any], starts: Iterable[datetime]) -> int:
    """Have the partitions that hold runs started at ``starts`` analyzed where they have grown
    past their last analyze (see ``agentcap.analyze_partitions``); in its own transaction.
    Returns how many were analyzed."""
    values = sorted(set(starts))
    if not values:
        return 0
    with conn.transaction():
        row = conn.execute(
            b"SELECT agentcap.analyze_partitions(%s::timestamptz[])", (values,)
        ).fetchone()
    return int(row[0]) if row else 0


def is_missing_partition(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL's "no partition of relation ... found for row"."""
    if not isinstance(exc, psycopg.errors.CheckViolation):
        return False
    message = exc.diag.message_primary or str(exc)
    return message.startswith("no partition of relation")


__all__ = [
    "ANALYZE_CHECK_FIRST",
    "ANALYZE_CHECK_MAX",
    "EVENTS_TABLE",
    "PARTITIONS_LOCK_KEY",
    "RETENTION_BARRIER_KEY",
    "AnalyzeSchedule",
    "LogPartition",
    "LogSettings",
    "PartitionCache",
    "PartitionSummary",
    "analyze_partitions",
    "ensure_ahead",
    "ensure_partitions",
    "is_missing_partition",
    "list_partitions",
    "parse_interval",
    "read_settings",
    "run_partitioned_tables",
    "set_partition_interval",
    "summarize",
]
