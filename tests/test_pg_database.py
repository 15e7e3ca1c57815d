"""Database: the capture path's queries and the coordination statements (tool ledger, spawn
registry, shared memory) have pools of their own, so neither waits for the other's connections,
and a statement of either on a hung database or a held lock is cancelled after quick_timeout."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

import otel_agentcap as ac
from otel_agentcap.capture.ledger import set_tool_ledger
from otel_agentcap.exporters.postgres import Database
from otel_agentcap.exporters.postgres.errors import ConnectionFailed
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
from otel_agentcap.exporters.postgres.partitions import RETENTION_BARRIER_KEY
from otel_agentcap.exporters.postgres.sequence_source import PostgresSequenceSource

pytestmark = pytest.mark.storage


def test_busy_coordination_connections_do_not_starve_the_capture_path(pg_dsn):
    """With every coordination connection taken, a capture-path query still gets a connection at
    once, and the other way round."""
    database = Database(pg_dsn, max_size=1)
    taken = threading.Event()
    release = threading.Event()

    def hold(use: str) -> None:
        connection = database.coordination if use == "coordination" else database.quick_connection
        with connection(timeout=5) as conn:
            conn.execute("SELECT 1")
            taken.set()
            release.wait(30)

    try:
        for holder, other in (
            ("coordination", database.quick_connection),
            ("quick", database.coordination),
        ):
            taken.clear()
            release.clear()
            thread = threading.Thread(target=hold, args=(holder,))
            thread.start()
            assert taken.wait(30)
            started = time.monotonic()
            with other(timeout=5) as conn:
                assert conn.execute("SELECT 2").fetchone() == (2,)
            assert time.monotonic() - started < 2.0
            release.set()
            thread.join(30)
    finally:
        release.set()
        database.close()


@pytest.mark.fault
def test_a_locked_ledger_table_makes_a_tool_call_wait_not_run_without_the_ledger(pg_dsn):
    """While a transaction holds the tool ledger's table locked (a migration, DDL), a protected
    call waits for the lock instead of running without the ledger: each statement gives up on
    the lock quickly and is asked again (counted in lock_waits), no cool-down starts, and once
    the lock is gone the call is claimed, runs once, and its retry is replayed from the ledger."""
    database = Database(pg_dsn, quick_timeout=0.5)
    database.ensure_schema()
    ledger = PostgresToolLedger(database, lease=2.0, timeout=5.0)
    calls: list[int] = []
    run_id = f"hang-{uuid.uuid4().hex[:10]}"

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n

    locker = psycopg.connect(pg_dsn)
    unlock = threading.Timer(2.0, locker.close)
    try:
        locker.execute("LOCK TABLE agentcap.tool_ledger IN ACCESS EXCLUSIVE MODE")
        unlock.start()
        set_tool_ledger(ledger)
        with ac.run(run_id), ac.agent("a"):
            assert work.invoke("w", 1) == 1
            assert work.invoke("w", 1) == 1
        assert calls == [1]
        stats = ledger.stats()
        assert stats.unavailable == 0 and stats.lock_waits >= 1, stats
        with database.coordination() as conn:  # no cool-down was started
            stored = conn.execute(
                "SELECT count(*) FROM agentcap.tool_ledger WHERE run_id = %s", (run_id,)
            ).fetchone()
        assert stored == (1,)
    finally:
        unlock.cancel()
        if not locker.closed:
            locker.rollback()
            locker.close()
        set_tool_ledger(None)
        ledger.close()
        database.close()


@pytest.mark.fault
@pytest.mark.parametrize(
    ("use", "application"),
    [("coordination", "otel-agentcap-coordination"), ("quick", "otel-agentcap-capture")],
)
def test_pooled_connections_the_server_closed_fail_no_statement(pg_dsn, use, application):
    """After the server closed every pooled connection (as a restart does), no statement fails:
    each stale connection is noticed before it is used (no round trip) and a new one taken,
    rather than each stale connection failing a statement in turn (or, before, the first)."""
    database = Database(pg_dsn, max_size=3)
    connection = database.coordination if use == "coordination" else database.quick_connection
    try:
        with connection(timeout=5) as a, connection(timeout=5) as b, connection(timeout=5) as c:
            for conn in (a, b, c):
                conn.execute("SELECT 1")
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            active = (
                "FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s"
            )
            admin.execute(f"SELECT pg_terminate_backend(pid) {active}", (application,))
            deadline = time.monotonic() + 30
            while admin.execute(f"SELECT count(*) {active}", (application,)).fetchone() != (0,):
                assert time.monotonic() < deadline, "the backends did not end"
                time.sleep(0.05)
        failures = 0
        for _ in range(4):
            try:
                with connection(timeout=5, cooldown=0.0) as conn:
                    conn.execute("SELECT 1")
            except (ConnectionFailed, psycopg.OperationalError):
                failures += 1
        assert failures == 0
    finally:
        database.close()


@pytest.mark.fault
@pytest.mark.parametrize("first", ["coordination", "quick"])
def test_a_connection_the_server_closed_renews_both_capture_pools(pg_dsn, first):
    """When the server closed every connection (a restart), neither pool hands out a connection
    from before it: whichever pool is used first, every statement connects afresh and none
    fails."""
    database = Database(pg_dsn, max_size=2)
    uses = {"coordination": database.coordination, "quick": database.quick_connection}
    other = "quick" if first == "coordination" else "coordination"
    try:
        for use in uses.values():
            with use(timeout=5) as a, use(timeout=5) as b:
                a.execute("SELECT 1")
                b.execute("SELECT 1")
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            active = (
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name LIKE 'otel-agentcap-%%'"
            )
            admin.execute(f"SELECT pg_terminate_backend(pid) {active}")
            deadline = time.monotonic() + 30
            while admin.execute(f"SELECT count(*) {active}").fetchone() != (0,):
                assert time.monotonic() < deadline, "the backends did not end"
                time.sleep(0.05)
        failed = []
        for use in (first, other, other, first):
            try:
                with uses[use](timeout=5, cooldown=0.0) as conn:
                    conn.execute("SELECT 1")
            except (ConnectionFailed, psycopg.OperationalError):
                failed.append(use)
        assert failed == []
    finally:
        database.close()


def test_a_connection_on_a_descriptor_above_1023_is_not_taken_for_closed(pg_dsn):
    """The idle check works for any descriptor: select() refuses those from 1024 on, which a
    process with many files open gives its connections, and every one would be dropped as closed
    by the server (a new connection for every statement)."""
    import os
    import resource

    from otel_agentcap.exporters.postgres.connection import closed_by_server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files ({hard}) is under 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            assert conn.fileno() >= 1024
            conn.execute("SELECT 1")
            assert not closed_by_server(conn)
            with psycopg.connect(pg_dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
            deadline = time.monotonic() + 30
            while not closed_by_server(conn):
                assert time.monotonic() < deadline, "the closed connection was never noticed"
                time.sleep(0.05)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.fault
def test_a_cancelled_capture_path_query_leaves_the_tool_ledger_available(pg_dsn):
    """A sequence reservation cancelled at the statement timeout while it waited for a lock (the
    retention barrier ``db prune`` holds) makes the capture path fail fast for its cool-down, but
    not the coordination statements: the next protected tool call is claimed in the ledger, not
    run unprotected."""
    database = Database(pg_dsn, quick_timeout=0.5)
    database.ensure_schema()
    ledger = PostgresToolLedger(database)
    source = PostgresSequenceSource(database)
    calls: list[int] = []
    run_id = f"barrier-{uuid.uuid4().hex[:10]}"

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n

    try:
        with psycopg.connect(pg_dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (RETENTION_BARRIER_KEY,))
            with pytest.raises(ConnectionFailed):
                source.reserve(run_id, "a", at_least=1, size=16)
        with pytest.raises(ConnectionFailed, match="moments ago"):  # the capture path cools down
            source.reserve(run_id, "a", at_least=1, size=16)
        set_tool_ledger(ledger)
        with ac.run(run_id), ac.agent("a"):
            assert work.invoke("w", 1) == 1
        assert calls == [1]
        assert ledger.stats().unavailable == 0
        with database.coordination() as conn:
            stored = conn.execute(
                "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s", (run_id,)
            ).fetchall()
        assert stored == [("succeeded",)]
    finally:
        set_tool_ledger(None)
        ledger.close()
        database.close()
