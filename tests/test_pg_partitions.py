"""Partitions by run start: created on write, ahead and by interval; a run never straddles two."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_log import run_batch
from psycopg import sql
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres import partitions
from otel_agentcap.exporters.postgres.migrate import available_migrations
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import Batch, Event, RunRecord, SpanRecord, event_id_for

pytestmark = pytest.mark.storage

UTC0 = datetime(2000, 1, 1, tzinfo=UTC)


@pytest.fixture()
def pool(pg_dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(pg_dsn, min_size=1, max_size=4, open=True) as p:
        yield p


def _ranges(conn: psycopg.Connection[Any], table: str = "agentcap.events") -> list[tuple]:
    return [(p.lower, p.upper) for p in partitions.list_partitions(conn, [table])]


def _event(run: str, agent: str, seq: int, at: datetime, key: str | None = None) -> Event:
    key = key or f"seq:{seq}"
    return Event(event_id_for(run, agent, key), run, agent, seq, "memory_write", key, at)


def test_advisory_lock_keys_match_the_migration():
    """The partition lock key the SQL function takes is the one prune takes in Python."""
    text = next(m.sql_text for m in available_migrations() if m.name == "run_partitions")
    assert f"pg_advisory_xact_lock({partitions.PARTITIONS_LOCK_KEY})" in text
    assert partitions.PARTITIONS_LOCK_KEY != partitions.RETENTION_BARRIER_KEY


def test_writer_creates_the_partition_of_a_new_run_start(pool):
    """A run whose start no partition holds gets one (for events and conflicts) on its first
    write, and its rows land in it."""
    start = datetime(2025, 5, 10, 13, 0, tzinfo=UTC)
    result = EventWriter(pool).write(run_batch("r-2025", start))
    assert result.inserted > 0
    month = (datetime(2025, 5, 1, tzinfo=UTC), datetime(2025, 6, 1, tzinfo=UTC))
    with pool.connection() as conn:
        assert month in _ranges(conn)
        assert month in _ranges(conn, "agentcap.conflicts")
        holders = conn.execute(
            "SELECT DISTINCT tableoid::regclass::text FROM agentcap.events WHERE run_id = 'r-2025'"
        ).fetchall()
    assert holders == [("agentcap.events_p20250501",)]


def test_concurrent_writers_of_one_new_range_create_it_once(pg_dsn):
    """Eight writers storing runs of the same new month at once: one partition, every row stored."""
    start = datetime(2025, 3, 3, tzinfo=UTC)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    inserted: list[int] = []

    def write(i: int) -> None:
        try:
            with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as p:
                writer = EventWriter(p)
                batch = run_batch(f"r-{i}", start + timedelta(hours=i))
                barrier.wait()
                inserted.append(writer.write(batch).inserted)
                writer.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with psycopg.connect(pg_dsn) as conn:
        assert [r for r in _ranges(conn) if r[0].year == 2025] == [
            (datetime(2025, 3, 1, tzinfo=UTC), datetime(2025, 4, 1, tzinfo=UTC))
        ]
        assert conn.execute("SELECT count(*) FROM agentcap.events").fetchone() == (sum(inserted),)


def test_run_start_is_fixed_by_its_first_write(pool):
    """A later batch with earlier events neither moves the run's start nor its partition; moving
    the start by hand is refused."""
    writer = EventWriter(pool)
    first = datetime(2025, 2, 1, 0, 30, tzinfo=UTC)
    writer.write(Batch((_event("r", "a", 5, first),)))
    earlier = datetime(2025, 1, 31, 23, 0, tzinfo=UTC)  # in January
    writer.write(Batch((_event("r", "b", 0, earlier),), runs=(RunRecord("r", earlier),)))
    with pool.connection() as conn:
        assert conn.execute("SELECT started_at FROM agentcap.runs").fetchone() == (first,)
        rows = conn.execute(
            "SELECT DISTINCT tableoid::regclass::text, run_started_at FROM agentcap.events"
        ).fetchall()
        assert rows == [("agentcap.events_p20250201", first)]
        with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="cannot change"):
            conn.execute("UPDATE agentcap.runs SET started_at = started_at - interval '1 day'")


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    runs=st.lists(
        st.tuples(
            st.integers(0, 400),  # run start, in days after 2024-01-01
            st.lists(st.integers(-40, 90), min_size=1, max_size=12),  # event offsets in days
            st.integers(1, 4),  # batches the run's events are split into
        ),
        min_size=1,
        max_size=5,
    ),
    order=st.randoms(use_true_random=False),
)
def test_a_run_never_straddles_partitions(pool, runs, order):
    """Whatever the times of its events and spans and the order its batches arrive in, every row
    of a run (events, conflicts, span envelopes) is in the one partition that holds the run's
    stored start, and carries that start."""
    writer = EventWriter(pool)
    base = datetime(2024, 1, 1, tzinfo=UTC)
    batches = []
    names = []
    for start_day, offsets, parts in runs:
        run = f"r-{uuid.uuid4().hex[:8]}"
        names.append(run)
        events = [
            _event(run, f"a{i % 3}", i, base + timedelta(days=start_day + off))
            for i, off in enumerate(offsets)
        ]
        # A second copy of the first event under another key collides on (run, agent, seq): a
        # conflicts row, which must live with the run too.
        events.append(_event(run, "a0", 0, events[0].wall_time, key="other"))
        for i in range(parts):
            at = events[i % len(events)].wall_time
            span = SpanRecord(run, "a" * 32, f"{i + 1:016x}", None, "work", 0, at, at)
            batches.append(Batch(tuple(events[i::parts]), spans=(span,)))
    order.shuffle(batches)
    for batch in batches:
        writer.write(batch)
    with pool.connection() as conn:
        for run in names:
            for table in ("events", "conflicts", "spans"):
                rows = conn.execute(
                    sql.SQL(
                        "SELECT DISTINCT x.tableoid::regclass::text, x.run_started_at = r.started_at,"
                        " p.lower <= r.started_at AND r.started_at < p.upper"
                        " FROM agentcap.{} x JOIN agentcap.runs r USING (run_id)"
                        " JOIN agentcap.log_partitions({}::regclass) p"
                        " ON p.partition = x.tableoid::regclass"
                        " WHERE x.run_id = %s"
                    ).format(sql.Identifier(table), sql.Literal(f"agentcap.{table}")),
                    (run,),
                ).fetchall()
                assert len(rows) == 1 and rows[0][1:] == (True, True), (run, table, rows)


def test_partition_range_is_utc_and_aligned(pg_dsn):
    """partition_range gives whole months from 2000-01 and date_bin steps from Monday 2000-01-03,
    in UTC whatever the session's time zone."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SET TimeZone = 'America/New_York'")

        def bounds(ts: str, step: str) -> tuple[datetime, datetime]:
            row = conn.execute(
                "SELECT lower, upper FROM agentcap.partition_range(%s::timestamptz, %s::interval)",
                (ts, step),
            ).fetchone()
            assert row is not None
            return row[0].astimezone(UTC), row[1].astimezone(UTC)

        assert bounds("2025-03-31 23:30:00-05", "1 month") == (
            datetime(2025, 4, 1, tzinfo=UTC),
            datetime(2025, 5, 1, tzinfo=UTC),
        )
        assert bounds("2025-05-17 00:00:00+00", "3 months") == (
            datetime(2025, 4, 1, tzinfo=UTC),
            datetime(2025, 7, 1, tzinfo=UTC),
        )
        assert bounds("2025-05-17 12:00:00+00", "7 days") == (  # a Saturday
            datetime(2025, 5, 12, tzinfo=UTC),
            datetime(2025, 5, 19, tzinfo=UTC),
        )
        assert bounds("1999-12-31 23:59:00+00", "6 hours") == (
            datetime(1999, 12, 31, 18, tzinfo=UTC),
            datetime(2000, 1, 1, tzinfo=UTC),
        )
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("UPDATE agentcap.log_settings SET partition_interval = '1 month 2 days'")


def test_a_new_interval_fits_between_existing_partitions(pool):
    """After a switch from months to weeks, new partitions are week-aligned but never overlap the
    months that exist: the first one is narrowed to start where the month ends."""
    writer = EventWriter(pool)
    writer.write(Batch((_event("jan", "a", 0, datetime(2025, 1, 20, tzinfo=UTC)),)))
    with pool.connection() as conn:
        partitions.set_partition_interval(conn, "7 days")
    writer.write(Batch((_event("feb", "a", 0, datetime(2025, 2, 2, tzinfo=UTC)),)))
    writer.write(Batch((_event("feb2", "a", 0, datetime(2025, 2, 12, tzinfo=UTC)),)))
    with pool.connection() as conn:
        early = [r for r in _ranges(conn) if r[0].year == 2025]
    jan, feb = (datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 2, 1, tzinfo=UTC))
    assert early == [
        (jan, feb),  # January, as it was
        (feb, feb + timedelta(days=2)),  # the week of Monday Jan 27, narrowed to start on Feb 1
        (feb + timedelta(days=9), feb + timedelta(days=16)),  # the week of Monday Feb 10
    ]


def test_ensure_ahead_and_cli_names_are_stable(pg_dsn):
    """ensure_ahead creates this and the next intervals once; partitions are named by their lower
    bound, with the time when it is not midnight."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        before = len(partitions.list_partitions(conn))
        created = partitions.ensure_ahead(conn, 3)
        again = partitions.ensure_ahead(conn, 3)
        partitions.set_partition_interval(conn, "6 hours")
        partitions.ensure_partitions(conn, [datetime(2040, 1, 1, 7, tzinfo=UTC)])
        names = {p.partition for p in partitions.list_partitions(conn)}
        after = len(partitions.list_partitions(conn))
    tables = len(partitions.run_partitioned_tables(psycopg.connect(pg_dsn)))
    assert tables == 3  # events, conflicts, spans
    assert again == 0
    # The migration created now and the next interval: 3 ahead adds two months, per table.
    assert created == 2 * tables and after == before + 3 * tables
    assert "agentcap.events_p20400101t0600" in names
    assert all(
        re.fullmatch(r"agentcap\.(events|conflicts|spans)_p\d{8}(t\d{4})?", n) for n in names
    )


def test_a_table_missing_its_partition_gets_it_on_write(pool):
    """If only events has the partition of a run (conflicts lost it), the write that needs it
    creates it and stores the conflict."""
    writer = EventWriter(pool)
    at = datetime(2026, 6, 6, tzinfo=UTC)
    writer.write(Batch((_event("r", "a", 0, at),)))
    with pool.connection() as conn:
        conn.execute("DROP TABLE agentcap.conflicts_p20260601")
        conn.commit()
    result = writer.write(Batch((_event("r", "a", 0, at, key="different"),)))
    assert result.conflicts == 1
    with pool.connection() as conn:
        assert conn.execute(
            "SELECT tableoid::regclass::text FROM agentcap.conflicts"
        ).fetchall() == [("agentcap.conflicts_p20260601",)]


def test_a_role_without_create_rights_still_extends_the_log(pg_dsn):
    """A writer role that owns nothing (so cannot ATTACH) stores a run of a new month through the
    SECURITY DEFINER function."""
    role = f"agentcap_writer_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD 'x'").format(ident))
        try:
            admin.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA agentcap TO {}").format(ident))
            admin.execute(
                sql.SQL(
                    "GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA agentcap TO {}"
                ).format(ident)
            )
            admin.execute(
                sql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA agentcap TO {}").format(ident)
            )
            dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=role, password="x")
            with (
                psycopg.connect(dsn, autocommit=True) as conn,
                pytest.raises(psycopg.errors.InsufficientPrivilege),
            ):
                conn.execute(
                    "CREATE TABLE agentcap.mine (LIKE agentcap.events);"
                    " ALTER TABLE agentcap.events ATTACH PARTITION agentcap.mine"
                    " FOR VALUES FROM ('2050-01-01') TO ('2050-02-01')"
                )
            with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as p:
                writer = EventWriter(p)
                result = writer.write(run_batch("r-2024", datetime(2024, 1, 5, tzinfo=UTC)))
                writer.close()
            assert result.inserted > 0
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_events_and_conflicts_stay_append_only_in_every_partition(pg_dsn, pool):
    """0004's append-only triggers hold in every partition, the ones created later too: by the
    writer for a new run start, by a memory write of a run of a new month, and ahead by
    `otel-agentcap db partitions --ahead`; an UPDATE through the parent or of the partition itself
    is refused."""
    writer = EventWriter(pool)
    writer.write(run_batch("written", datetime(2025, 3, 3, tzinfo=UTC)))
    twin = _event("written", "planner", 0, datetime(2025, 3, 4, tzinfo=UTC), key="twin")
    assert writer.write(Batch((twin,))).conflicts == 1
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT * FROM agentcap.memory_write('remembered', 'm', 'k', 'set', true, '1'::jsonb,"
            " NULL, 'a', %s, 1, '2024-07-07', NULL, NULL, NULL)",
            (event_id_for("remembered", "a", "seq:1"),),
        )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_agentcap.cli",
            "db",
            "partitions",
            "--ahead",
            "3",
            "--dsn",
            pg_dsn,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        names = {p.partition for p in partitions.list_partitions(conn)}
        assert {
            "agentcap.events_p20250301",
            "agentcap.conflicts_p20250301",
            "agentcap.events_p20240701",
        } <= names
        refused = 0
        for table in ("events", "conflicts"):
            for (partition,) in conn.execute(
                "SELECT partition::text FROM agentcap.log_partitions(%s::regclass)",
                (f"agentcap.{table}",),
            ).fetchall():
                triggers = conn.execute(
                    "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND tgenabled = 'O'",
                    (partition,),
                ).fetchall()
                assert triggers == [(f"{table}_append_only",)], partition
                held = conn.execute(f"SELECT count(*) FROM {partition}").fetchone()
                if not held or not held[0]:
                    continue
                for target in (partition, f"agentcap.{table}"):
                    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                        conn.execute(
                            f"UPDATE {target} SET payload = '{{}}' WHERE tableoid = %s::regclass",
                            (partition,),
                        )
                refused += 1
        assert refused == 3  # March 2025 (events, conflicts), July 2024 (events)
