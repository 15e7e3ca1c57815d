"""db prune: whole runs before the cut go, with every row that belongs to them; writers go on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pg_log import COORDINATION_TABLES, coordinate, orphans, rows_of_runs, run_batch, write_runs
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres import partitions, retention
from otel_agentcap.exporters.postgres.partitions import LogPartition
from otel_agentcap.exporters.postgres.sequences import reserve_sequence_block
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import Batch, Event, event_id_for

pytestmark = pytest.mark.storage


def _at(month: int, day: int = 1) -> datetime:
    return datetime(2025, month, day, tzinfo=UTC)


@pytest.fixture()
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def _late_event(run: str, seq: int, at: datetime, key: str | None = None) -> Event:
    key = key or f"seq:{seq}"
    return Event(event_id_for(run, "late", key), run, "late", seq, "memory_write", key, at)


def _runs(conn: psycopg.Connection[Any]) -> set[str]:
    return {str(r[0]) for r in conn.execute("SELECT run_id FROM agentcap.runs")}


def _no_orphans(conn: psycopg.Connection[Any]) -> None:
    """No row of any per-run table (the coordination tables and record_conflicts included) lacks
    its run or sits in another partition than its run's start."""
    found = orphans(conn)
    assert {*COORDINATION_TABLES, "record_conflicts", "agents", "events", "spans"} <= set(found)
    assert found == dict.fromkeys(found, 0)


def _record_conflict(conn: psycopg.Connection[Any], run_id: str) -> None:
    conn.execute(
        "INSERT INTO agentcap.record_conflicts (run_id, agent_id, reason, stored, offered,"
        " row_digest) VALUES (%s, 'planner', 'agent_name', '{}', '{}', %s)",
        (run_id, f"digest-{run_id}"),
    )


def _event_ids(conn: psycopg.Connection[Any], run_ids: set[str]) -> set[str]:
    return {
        str(r[0])
        for r in conn.execute(
            "SELECT event_id FROM agentcap.events WHERE run_id = ANY(%s)", (list(run_ids),)
        )
    }


def test_prune_removes_whole_runs_before_the_cut(pg_dsn, admin):
    """Runs started in January and February go (also one whose events reach into April), with
    their agents, sequence rows and conflicts; runs from March on stay whole, even the one that
    started on the date given, since its partition ends after it."""
    write_runs(pg_dsn, [("jan", _at(1, 10)), ("feb", _at(2, 27)), ("mar", _at(3, 1))])
    write_runs(pg_dsn, [("mar-15", _at(3, 15)), ("apr", _at(4, 2))])
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        # The February run goes on in another process two months later, and collides once.
        late = [_late_event("feb", i, _at(4, 20)) for i in range(5)]
        writer.write(Batch(tuple(late)))
        collide = _late_event("feb", 0, _at(4, 21), key="other")
        assert writer.write(Batch((collide,))).conflicts == 1
        for run in ("jan", "feb", "mar-15"):
            reserve_sequence_block(pool, run, "planner", at_least=0, size=10)
    for n, (run, at) in enumerate((("jan", _at(1, 11)), ("feb", _at(4, 22)), ("mar", _at(3, 2)))):
        coordinate(admin, run, at, n=n)  # a tool claim, a spawn, a memory write and its event
        _record_conflict(admin, run)
    kept = {"mar", "mar-15", "apr"}
    kept_events = _event_ids(admin, kept)
    kept_rows = rows_of_runs(admin, kept)
    assert all(rows_of_runs(admin, {"jan", "feb"})[t] > 0 for t in COORDINATION_TABLES)
    agents = admin.execute(
        "SELECT count(*) FROM agentcap.agents WHERE run_id IN ('jan', 'feb')"
    ).fetchone()
    result = retention.prune(admin, _at(3, 15))
    assert result.pruned_before == _at(3, 1)
    assert result.runs == 2
    assert {p.partition for p in result.partitions} == {
        f"agentcap.{table}_p2025{month}01"
        for table in ("events", "conflicts", "spans")
        for month in ("01", "02")
    }
    assert (result.rows["agents"],) == agents and result.rows["agent_sequences"] == 2
    assert _runs(admin) == kept
    assert _event_ids(admin, kept) == kept_events
    assert _event_ids(admin, {"jan", "feb"}) == set()
    assert rows_of_runs(admin, kept) == kept_rows
    gone = rows_of_runs(admin, {"jan", "feb"})
    assert gone == dict.fromkeys(gone, 0)
    assert all(result.rows[t] == 2 for t in (*COORDINATION_TABLES, "record_conflicts"))
    assert admin.execute("SELECT count(*) FROM agentcap.conflicts").fetchone() == (0,)
    _no_orphans(admin)
    assert [p.lower for p in partitions.list_partitions(admin, ["agentcap.events"])][:2] == [
        _at(3),
        _at(4),
    ]


def test_dry_run_changes_nothing(pg_dsn, admin):
    """--dry-run reports the cut, the runs and the partitions, and leaves the log as it was."""
    write_runs(pg_dsn, [("jan", _at(1, 10)), ("mar", _at(3, 1))])
    before = partitions.list_partitions(admin)
    result = retention.prune(admin, _at(2, 10), dry_run=True)
    assert (result.pruned_before, result.runs, result.dry_run) == (_at(2), 1, True)
    assert {p.partition for p in result.partitions} == {
        "agentcap.events_p20250101",
        "agentcap.conflicts_p20250101",
        "agentcap.spans_p20250101",
    }
    assert partitions.list_partitions(admin) == before
    assert _runs(admin) == {"jan", "mar"}
    assert partitions.read_settings(admin).pruned_before is None


def test_nothing_before_the_first_partition_is_a_no_op(pg_dsn, admin):
    """A date before every partition prunes nothing and moves no watermark."""
    write_runs(pg_dsn, [("mar", _at(3, 1))])
    result = retention.prune(admin, _at(2, 10))
    assert (result.pruned_before, result.partitions, result.runs) == (None, [], 0)
    assert partitions.read_settings(admin).pruned_before is None


def test_writes_of_pruned_runs_are_refused_and_counted(pg_dsn, admin):
    """After a prune, a late batch of a pruned run (whatever the times of its events) or of a new
    run that started before the cut is not stored, creates no partition and no runs row, and is
    counted as expired."""
    write_runs(pg_dsn, [("jan", _at(1, 10)), ("mar", _at(3, 1))])
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        writer.write(Batch((_late_event("jan", 0, _at(1, 11)),)))  # knows January's partition
        retention.prune(admin, _at(2))
        late = Batch(tuple(_late_event("jan", i, _at(1, 12)) for i in range(1, 6)))
        result = writer.write(late)
        december = run_batch("dec", datetime(2024, 12, 24, tzinfo=UTC))
        fresh = writer.write(december)
        kept = writer.write(Batch((_late_event("mar", 0, _at(3, 2)),)))
        # Events of the pruned run with times after the cut do not make it a new run either.
        later = writer.write(Batch(tuple(_late_event("jan", i, _at(3, 20)) for i in range(6, 9))))
    assert (later.inserted, later.expired) == (0, 3)
    assert admin.execute("SELECT run_id FROM agentcap.pruned_runs").fetchall() == [("jan",)]
    assert (result.inserted, result.expired) == (0, 5)
    assert (fresh.inserted, fresh.expired) == (0, len(december.events))
    assert kept.inserted > 0 and kept.expired == 0
    assert _runs(admin) == {"mar"}
    assert min(p.lower for p in partitions.list_partitions(admin, ["agentcap.events"])) == _at(3)
    _no_orphans(admin)


def test_prune_while_writers_keep_inserting(pg_dsn, admin):
    """Two writers insert batches of old and new runs throughout a prune, and a process of those
    runs claims tools, registers spawns and writes memory: no error; every event a writer stored
    for a kept run is in the log, every memory write of a kept run too; the old runs are gone
    whole, their late coordination refused; nothing is orphaned in any table."""
    write_runs(pg_dsn, [(f"old-{i}", _at(1, 1 + i)) for i in range(10)])
    write_runs(pg_dsn, [(f"new-{i}", _at(3, 1 + i)) for i in range(10)])
    stop = threading.Event()
    stored: dict[str, set[str]] = {}
    errors: list[BaseException] = []
    expired = [0]
    lock = threading.Lock()

    def keep_writing(name: str) -> None:
        try:
            with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
                writer = EventWriter(pool)
                i = 0
                last = False
                while not last:
                    last = stop.is_set()  # one more batch once prune has returned
                    old = [_late_event(f"old-{i % 10}", i, _at(1, 1 + i % 10))]
                    new = run_batch(f"{name}-{i}", _at(3, 1) + timedelta(hours=i), seed=i)
                    result = writer.write(Batch((*old, *new.events), new.agents))
                    with lock:
                        expired[0] += result.expired
                        if result.inserted:
                            stored[new.events[0].run_id] = {e.event_id for e in new.events}
                    i += 1
                writer.close()
        except BaseException as exc:
            errors.append(exc)

    refused = [0]
    coordinated: set[tuple[str, str]] = set()

    def keep_coordinating() -> None:
        # What the capture path writes outside the exporter (tool ledger, spawns, memory with its
        # event), for old and new runs alike, through the SQL functions it calls.
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                i = 0
                last = False
                while not last:
                    last = stop.is_set()
                    reserve_sequence_block(conn, f"old-{i % 10}", "coordinator", at_least=0, size=8)
                    try:
                        coordinate(conn, f"old-{i % 10}", _at(1, 20), n=i)
                    except psycopg.errors.ObjectNotInPrerequisiteState:
                        refused[0] += 1
                    coordinate(conn, f"new-{i % 10}", _at(3, 20), n=i)
                    coordinated.add((f"new-{i % 10}", f"k{i}"))
                    i += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=keep_writing, args=(f"w{n}",)) for n in range(2)]
    threads.append(threading.Thread(target=keep_coordinating))
    for t in threads:
        t.start()
    time.sleep(0.5)
    result = retention.prune(admin, _at(2, 15))
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert result.pruned_before == _at(2)
    assert expired[0] > 0  # old runs kept arriving after the cut, and were refused
    assert refused[0] > 0
    memory = set(admin.execute("SELECT run_id, key FROM agentcap.memory").fetchall())
    assert coordinated <= memory
    assert not any(run.startswith("old-") for run, _ in memory)
    runs = _runs(admin)
    assert not any(r.startswith("old-") for r in runs)
    assert set(stored) <= runs
    for run_id, ids in stored.items():
        assert _event_ids(admin, {run_id}) == ids, run_id
    _no_orphans(admin)


def test_moving_the_watermark_and_a_write_creating_a_partition_do_not_deadlock(pg_dsn, admin):
    """A write transaction holds the retention barrier shared, then creates a partition (as
    memory_write does for a run's first event). A prune that moves the watermark in between waits
    for it; with the locks taken in the other order PostgreSQL aborted one of the two as a
    deadlock (seen in CI on PostgreSQL 15)."""
    errors: list[BaseException] = []
    moved: list[datetime] = []
    with psycopg.connect(pg_dsn) as writer:
        writer.execute(
            "SELECT pg_advisory_xact_lock_shared(%s)", (partitions.RETENTION_BARRIER_KEY,)
        )

        def move() -> None:
            try:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    moved.append(retention._move_watermark(conn, datetime(2000, 1, 1, tzinfo=UTC)))
            except BaseException as exc:
                errors.append(exc)

        mover = threading.Thread(target=move)
        mover.start()
        deadline = time.monotonic() + 30
        while not admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ).fetchone()[0]:
            assert time.monotonic() < deadline, "the prune never waited for the writer"
            time.sleep(0.02)
        writer.execute("SELECT agentcap.ensure_partitions(ARRAY[%s::timestamptz])", (_at(6),))
        writer.commit()
        mover.join(timeout=60)
    assert errors == []
    assert len(moved) == 1


def test_prune_waits_for_readers_without_blocking_writers(pg_dsn, admin):
    """While DETACH ... CONCURRENTLY waits for an open reader, writers of kept runs go on; prune
    finishes once the reader is done."""
    write_runs(pg_dsn, [("jan", _at(1, 10)), ("mar", _at(3, 1))])
    reader = psycopg.connect(pg_dsn)
    reader.execute("SELECT count(*) FROM agentcap.events").fetchone()  # holds events open
    done = threading.Event()
    outcome: list[Any] = []

    def run_prune() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            outcome.append(retention.prune(conn, _at(2)))
        done.set()

    pruner = threading.Thread(target=run_prune)
    pruner.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until prune waits in DETACH ... CONCURRENTLY
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%%DETACH PARTITION%%'"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            ).fetchone()
            if row and row[0]:
                break
            time.sleep(0.05)
        else:
            pytest.fail("prune never waited for the reader")
        with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
            writer = EventWriter(pool)
            for i in range(5):
                result = writer.write(run_batch(f"mar-{i}", _at(3, 2 + i)))
                assert result.inserted > 0
            writer.close()
        assert not done.is_set()
    finally:
        reader.close()
        pruner.join(timeout=60)
    assert done.is_set() and outcome[0].runs == 1
    assert _runs(admin) == {"mar"} | {f"mar-{i}" for i in range(5)}


def test_an_interrupted_prune_is_finished_by_the_next(pg_dsn, admin):
    """A prune cancelled while its detach waits leaves the partition detach-pending and the runs
    rows in place; the next prune finalizes the detach, drops it and removes the runs."""
    write_runs(pg_dsn, [("jan", _at(1, 10)), ("mar", _at(3, 1))])
    reader = psycopg.connect(pg_dsn)
    reader.execute("SELECT count(*) FROM agentcap.events").fetchone()
    failures: list[BaseException] = []

    def run_prune() -> None:
        try:
            with psycopg.connect(pg_dsn, autocommit=True, application_name="pruner") as conn:
                retention.prune(conn, _at(2))
        except BaseException as exc:
            failures.append(exc)

    pruner = threading.Thread(target=run_prune)
    pruner.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = admin.execute(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'pruner' AND wait_event_type = 'Lock'"
            ).fetchone()
            if row and row[0]:
                break
            time.sleep(0.05)
        pruner.join(timeout=30)
    finally:
        reader.close()
    assert len(failures) == 1 and isinstance(failures[0], psycopg.errors.QueryCanceled)
    pending = [p for p in partitions.list_partitions(admin) if p.detach_pending]
    assert len(pending) == 1
    assert "jan" in _runs(admin)
    result = retention.prune(admin, _at(1, 5))  # an earlier date: the watermark still applies
    assert result.pruned_before == _at(2)
    assert _runs(admin) == {"mar"}
    assert not any(p.lower < _at(2) for p in partitions.list_partitions(admin))
    _no_orphans(admin)


_bound = st.integers(0, 60).map(lambda d: datetime(2025, 1, 1, tzinfo=UTC) + timedelta(days=d))


@given(
    spans=st.lists(st.tuples(_bound, st.integers(1, 20)), max_size=12),
    before=_bound,
)
def test_the_cut_is_the_latest_bound_no_partition_straddles(spans, before):
    """prune_cut returns a partition's upper bound at or before the date that lies inside no
    partition, and no later such bound exists (or None)."""
    parts = [
        LogPartition("t", f"p{i}", lo, lo + timedelta(days=days))
        for i, (lo, days) in enumerate(spans)
    ]
    cut = retention.prune_cut(parts, before)

    def good(bound: datetime) -> bool:
        return bound <= before and not any(p.lower < bound < p.upper for p in parts)

    candidates = [p.upper for p in parts if good(p.upper)]
    assert cut == (max(candidates) if candidates else None)


def test_a_date_in_the_future_is_refused(pg_dsn, admin):
    """prune --before a future date would stop every run being written: refused, nothing moves."""
    write_runs(pg_dsn, [("jan", _at(1, 10))])
    future = datetime.now(UTC) + timedelta(days=40)
    with pytest.raises(ValueError, match="in the future"):
        retention.prune(admin, future)
    assert partitions.read_settings(admin).pruned_before is None
    assert _runs(admin) == {"jan"}


def test_coordination_of_a_pruned_run_is_refused(pg_dsn, admin):
    """After a prune, the tool ledger, the spawn registry and the shared memory refuse a pruned run
    (the error names db prune), a sequence reservation of it records nothing, so nothing is stored
    for it; a kept run goes on."""
    write_runs(pg_dsn, [("jan", _at(1, 10)), ("mar", _at(3, 1))])
    retention.prune(admin, _at(2))
    calls = {
        "tool_claim": "SELECT * FROM agentcap.tool_claim('jan', 'a', 'i', 'd', 't', 'o', 30, false)",
        "spawn_register": "SELECT * FROM agentcap.spawn_register('jan', 'a/c', 'a', 'c', NULL,"
        " gen_random_uuid(), 5, NULL, NULL)",
        "memory_write": "SELECT * FROM agentcap.memory_write('jan', 'm', 'k', 'set', true,"
        " '1'::jsonb, NULL, 'a', gen_random_uuid(), 7, now(), NULL, NULL, NULL)",
    }
    for name, call in calls.items():
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="db prune"):
            admin.execute(call)
            pytest.fail(f"{name} stored a pruned run")
    # A sequence block of a pruned run is handed out, not recorded.
    assert reserve_sequence_block(admin, "jan", "planner", at_least=40, size=10) == 40
    coordinate(admin, "mar", _at(3, 2))
    assert rows_of_runs(admin, {"jan"}) == dict.fromkeys(rows_of_runs(admin, {"jan"}), 0)
    assert all(rows_of_runs(admin, {"mar"})[t] == 1 for t in COORDINATION_TABLES)
    _no_orphans(admin)


def test_a_pruned_run_id_cannot_be_claimed_again(pg_dsn, admin):
    """ac.run() of an id that db prune removed finds it taken (its claim stores nothing), as it
    would find a stored run: the id is not silently reused for a new run."""
    from otel_agentcap.exporters.postgres.database import Database
    from otel_agentcap.exporters.postgres.recovery import PostgresRunRegistry

    write_runs(pg_dsn, [("jan", _at(1, 10))])
    retention.prune(admin, _at(2))
    database = Database(pg_dsn)
    try:
        registry = PostgresRunRegistry(database)
        assert registry.claim("jan", None, datetime.now(UTC)) is not None
        assert registry.claim("fresh", None, datetime.now(UTC)) is None
    finally:
        database.close()
    assert _runs(admin) == {"fresh"}
