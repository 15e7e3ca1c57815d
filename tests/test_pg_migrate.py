"""Schema migrations: idempotent, safe under concurrent starts."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from otel_agentcap.exporters.postgres.migrate import applied_versions, available_migrations, migrate

pytestmark = pytest.mark.storage

TABLES = {"runs", "agents", "events", "conflicts", "agent_sequences", "schema_version"}


def _tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'agentcap'"
        ).fetchall()
    return {r[0] for r in rows}


def test_migrate_creates_schema_and_records_versions(pg_empty_dsn: str) -> None:
    """A first migrate creates every table and records each shipped version once."""
    applied = migrate(pg_empty_dsn)
    assert applied == [m.version for m in available_migrations()]
    assert _tables(pg_empty_dsn) >= TABLES
    with psycopg.connect(pg_empty_dsn) as conn:
        assert applied_versions(conn) == set(applied)


def test_migrate_twice_is_a_no_op(pg_empty_dsn: str) -> None:
    """Running migrate again applies nothing and keeps the data."""
    migrate(pg_empty_dsn)
    with psycopg.connect(pg_empty_dsn) as conn:
        conn.execute("INSERT INTO agentcap.runs (run_id) VALUES ('keep')")
    assert migrate(pg_empty_dsn) == []
    with psycopg.connect(pg_empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM agentcap.runs").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM agentcap.schema_version").fetchone() == (
            len(available_migrations()),
        )


def test_migrate_accepts_a_connection(pg_empty_dsn: str) -> None:
    """migrate() works on an open connection as well as on a DSN."""
    with psycopg.connect(pg_empty_dsn) as conn:
        assert migrate(conn) != []
        assert migrate(conn) == []


def test_concurrent_migrate_from_threads(pg_empty_dsn: str) -> None:
    """Eight threads migrating at once apply each version exactly once, without errors."""
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: migrate(pg_empty_dsn), range(8)))
    applied = [v for r in results for v in r]
    assert sorted(applied) == [m.version for m in available_migrations()]


def _migrate_in_child(dsn: str) -> list[int]:
    return migrate(dsn)


@pytest.mark.multiprocess
def test_concurrent_migrate_from_processes(pg_empty_dsn: str) -> None:
    """Four processes migrating at once apply each version exactly once."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_migrate_in_child, [pg_empty_dsn] * 4)
    applied = [v for r in results for v in r]
    assert sorted(applied) == [m.version for m in available_migrations()]
