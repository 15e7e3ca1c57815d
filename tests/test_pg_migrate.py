"""Schema migrations: idempotent, safe under concurrent starts."""

from __future__ import annotations

import multiprocessing
import time
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


def _at_version_1(dsn: str) -> None:
    """The schema as migration 0001 left it."""
    first = available_migrations()[0]
    assert first.version == 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA agentcap")
        conn.execute(
            "CREATE TABLE agentcap.schema_version (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute(first.sql_text.encode())
        conn.execute("INSERT INTO agentcap.schema_version VALUES (1, %s)", (first.name,))


_INSERT_CALL = (
    "INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time, event_type,"
    " idempotency_key, payload) VALUES (%s, 'r', %s, 1, now(), 'model_call', 'k', %s)"
)


def test_migration_0002_waits_for_a_writer_of_an_earlier_version(pg_empty_dsn: str) -> None:
    """A writer that has not committed a second record of a call when 0002 starts: the migration
    waits for it, then moves that record too, instead of failing on its unique index."""
    _at_version_1(pg_empty_dsn)
    call = '{"response_id": "msg_1"}'
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute(_INSERT_CALL, ("00000000-0000-0000-0000-000000000001", "a", call))
    with psycopg.connect(pg_empty_dsn) as writer:
        writer.execute(_INSERT_CALL, ("00000000-0000-0000-0000-000000000002", "b", call))
        with ThreadPoolExecutor(1) as pool:
            migrating = pool.submit(migrate, pg_empty_dsn)
            time.sleep(1.0)  # the migration is now waiting for this transaction
            writer.commit()
            applied = migrating.result(timeout=60)
    assert applied == [m.version for m in available_migrations()][1:]
    with psycopg.connect(pg_empty_dsn) as conn:
        kept = conn.execute("SELECT agent_id FROM agentcap.events").fetchall()
        moved = conn.execute("SELECT agent_id, reason FROM agentcap.conflicts").fetchall()
    assert kept == [("a",)]
    assert moved == [("b", "model_call_response_id")]


def test_migration_0002_moves_existing_second_records_of_a_model_call(pg_empty_dsn: str) -> None:
    """A log written before 0002 may hold a call twice: the SDK's record (else the earliest) stays,
    the others move to agentcap.conflicts in full, and the unique indexes then exist."""
    _at_version_1(pg_empty_dsn)
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        rows = [
            # (event id suffix, agent, seconds, payload)
            (
                "01",
                "a",
                1,
                '{"response_id": "msg_1", "request_id": "req_1", "instrumentation": "x"}',
            ),
            (
                "02",
                "b",
                2,
                '{"response_id": "msg_1", "instrumentation": "com.anthropic.sdk.python"}',
            ),
            ("03", "c", 3, '{"request_id": "req_9"}'),
            ("04", "d", 4, '{"request_id": "req_9"}'),
            ("05", "e", 5, '{"response_id": 7}'),
            ("06", "f", 6, '{"response_id": 7}'),
        ]
        for suffix, agent, seconds, payload in rows:
            conn.execute(
                "INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time,"
                " event_type, idempotency_key, payload) VALUES (%s, 'r', %s, 1,"
                " '2025-01-01'::timestamptz + %s * interval '1 second', 'model_call', 'k', %s)",
                (f"00000000-0000-0000-0000-0000000000{suffix}", agent, seconds, payload),
            )
    assert migrate(pg_empty_dsn) == [m.version for m in available_migrations()][1:]
    with psycopg.connect(pg_empty_dsn) as conn:
        kept = [r[0] for r in conn.execute("SELECT agent_id FROM agentcap.events ORDER BY 1")]
        moved = conn.execute(
            "SELECT agent_id, reason, existing_event_id::text FROM agentcap.conflicts ORDER BY 1"
        ).fetchall()
        indexes = {
            r[0]
            for r in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = 'agentcap'"
                " AND indexname LIKE 'events_model_call_%'"
            )
        }
    # Non-string ids (7) do not identify a call.
    assert kept == ["b", "c", "e", "f"]
    assert moved == [
        ("a", "model_call_response_id", "00000000-0000-0000-0000-000000000002"),
        ("d", "model_call_request_id", "00000000-0000-0000-0000-000000000003"),
    ]
    assert indexes == {"events_model_call_response_id_key", "events_model_call_request_id_key"}
