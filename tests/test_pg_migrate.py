"""Schema migrations: idempotent, safe under concurrent starts."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from pg_log import coordinate, orphans, run_batch
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres.errors import MigrationError
from otel_agentcap.exporters.postgres.migrate import (
    MIGRATION_LOCK_KEY,
    applied_versions,
    available_migrations,
    migrate,
)
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import Batch, event_id_for

pytestmark = pytest.mark.storage

TABLES = {
    "runs",
    "agents",
    "events",
    "conflicts",
    "agent_sequences",
    "schema_version",
    "log_settings",
    "pruned_runs",
}


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


def test_a_statement_timeout_of_the_database_does_not_cut_a_migration_short(
    pg_empty_dsn: str,
) -> None:
    """A statement_timeout the DBA set for the role or database (100 ms here) cancels neither a
    migration nor its wait for another process's migration lock (held here well past it): the
    migrations run without one, and the session keeps its setting afterwards."""
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET statement_timeout = '100ms'")
    with (
        psycopg.connect(pg_empty_dsn, autocommit=True) as holder,
        psycopg.connect(pg_empty_dsn, autocommit=True) as conn,
        ThreadPoolExecutor(1) as pool,
    ):
        holder.execute("SET statement_timeout = 0")
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        applying = pool.submit(migrate, conn)
        waiting = (
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)"
        )
        while holder.execute(waiting).fetchone() != (True,):
            assert not applying.done(), applying.result()
            time.sleep(0.01)
        time.sleep(0.5)  # waiting five times the timeout
        holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
        assert applying.result() == [m.version for m in available_migrations()]
        assert conn.execute("SHOW statement_timeout").fetchone() == ("100ms",)


def test_a_lock_timeout_fails_the_migration_as_rolled_back_not_as_a_lost_connection(
    pg_empty_dsn: str,
) -> None:
    """With a lock_timeout on the database and another session holding the migration lock, the
    migration gives up as a MigrationError saying it was rolled back (the connection was never
    lost), and applies nothing."""
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET lock_timeout = '100ms'")
    with psycopg.connect(pg_empty_dsn, autocommit=True) as holder:
        holder.execute("SET lock_timeout = 0")
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        with pytest.raises(MigrationError, match="rolled back"):
            migrate(pg_empty_dsn)
    with psycopg.connect(pg_empty_dsn) as conn:
        assert applied_versions(conn) == set()


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


_INSERT_CALL = (
    "INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time, event_type,"
    " idempotency_key, payload) VALUES (%s, 'r', %s, 1, now(), 'model_call', 'k', %s)"
)


def test_migration_0002_waits_for_a_writer_of_an_earlier_version(pg_empty_dsn: str) -> None:
    """A writer that has not committed a second record of a call when 0002 starts: the migration
    waits for it, then moves that record too, instead of failing on its unique index."""
    _at_version(pg_empty_dsn, 1)
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
    _at_version(pg_empty_dsn, 1)
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


def _at_version(dsn: str, version: int) -> None:
    """The schema as migrations 0001 to ``version`` left it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA agentcap")
        conn.execute(
            "CREATE TABLE agentcap.schema_version (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for migration in available_migrations()[:version]:
            with conn.transaction():
                conn.execute(migration.sql_text.encode())
                conn.execute(
                    "INSERT INTO agentcap.schema_version VALUES (%s, %s)",
                    (migration.version, migration.name),
                )


_V2_EVENT = (
    "INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time, event_type,"
    " causal_parent_ids, idempotency_key, trace_id, span_id, payload)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
_V3_SPAN = (
    "INSERT INTO agentcap.spans (run_id, trace_id, span_id, name, start_time, end_time)"
    " VALUES (%s, %s, %s, %s, %s, %s)"
)
_V2_CONFLICT = (
    "INSERT INTO agentcap.conflicts (reason, existing_event_id, row_digest, event_id, run_id,"
    " agent_id, logical_seq, wall_time, event_type, causal_parent_ids, idempotency_key, payload)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)


def _seed_version_5(dsn: str) -> list[Batch]:
    """A log written before 0006: runs over three months with their spans, one run with no runs
    row, one whose start is unknown, one runs row without events, one run of a root span only,
    conflicts, record conflicts, agents and sequence blocks, and what processes of the runs wrote
    through the functions of 0005 (tool ledger, spawns, memory with its events)."""
    batches = []
    for i in range(10):
        batch = run_batch(f"run-{i}", datetime(2025, 1, 1, tzinfo=UTC) + timedelta(days=9 * i))
        events = tuple(
            e._replace(trace_id="0af7651916cd43dd8448eb211c80319c", span_id=f"{k:016x}")
            for k, e in enumerate(batch.events)
        )
        batches.append(batch._replace(events=events))
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        for n, batch in enumerate(batches):
            run_id = batch.events[0].run_id
            cur.executemany(
                _V2_EVENT,
                [
                    (
                        e.event_id,
                        e.run_id,
                        e.agent_id,
                        e.seq,
                        e.wall_time,
                        e.event_type,
                        list(e.causal_parent_ids),
                        e.idempotency_key,
                        e.trace_id,
                        e.span_id,
                        Jsonb(e.payload),
                    )
                    for e in batch.events
                ],
            )
            if n != 3:  # run-3 has events and no runs row
                started = None if n == 5 else batch.runs[0].started_at  # run-5: start unknown
                cur.execute(
                    "INSERT INTO agentcap.runs (run_id, started_at, attributes) VALUES (%s, %s, %s)",
                    (run_id, started, Jsonb({"n": n})),
                )
            cur.executemany(
                "INSERT INTO agentcap.agents (run_id, agent_id, parent_agent_id,"
                " spawned_at_event_id, name) VALUES (%s, %s, %s, %s, %s)",
                [
                    (a.run_id, a.agent_id, a.parent_agent_id, a.spawned_at_event_id, a.name)
                    for a in batch.agents
                ],
            )
            cur.execute(
                "INSERT INTO agentcap.agent_sequences VALUES (%s, 'planner', %s)", (run_id, 64 + n)
            )
            cur.executemany(
                _V3_SPAN,
                [
                    (e.run_id, e.trace_id, e.span_id, e.event_type, e.wall_time, e.wall_time)
                    for e in batch.events
                ],
            )
            first = batch.events[1]
            for reason, existing in (("run_agent_seq", batch.events[0].event_id), ("x", None)):
                cur.execute(
                    _V2_CONFLICT,
                    (
                        reason if existing else "invalid_event_type",
                        existing,
                        f"digest-{reason}-{run_id}",
                        uuid.uuid4(),
                        run_id,
                        first.agent_id,
                        first.seq,
                        first.wall_time,
                        first.event_type,
                        [],
                        f"other-{reason}",
                        Jsonb({"other": reason}),
                    ),
                )
            cur.execute(
                "INSERT INTO agentcap.record_conflicts (run_id, agent_id, reason, stored, offered,"
                " row_digest) VALUES (%s, 'planner', 'agent_name', '{}', %s, 'd')",
                (run_id, Jsonb({"name": f"other-{n}"})),
            )
            # Through 0005's functions, as a process of the run does: run-3 (no runs row) too.
            coordinate(cur.connection, run_id, batch.events[-1].wall_time, n=n)
        cur.execute(
            "INSERT INTO agentcap.runs (run_id, attributes, recorded_at)"
            " VALUES ('empty', '{}', '2025-02-02')"
        )
        root = datetime(2025, 3, 3, tzinfo=UTC)
        cur.execute(_V3_SPAN, ("root-only", "1" * 32, "2" * 16, "invoke_workflow", root, root))
    return batches


def _snapshot(conn: psycopg.Connection[Any]) -> dict[str, set[tuple[Any, ...]]]:
    columns = {
        "events": "event_id, run_id, agent_id, logical_seq, wall_time, event_type,"
        " causal_parent_ids::text, idempotency_key, trace_id, span_id, payload::text",
        "conflicts": "conflict_id, detected_at, reason, existing_event_id, row_digest, event_id,"
        " run_id, agent_id, logical_seq, wall_time, event_type, causal_parent_ids::text,"
        " idempotency_key, trace_id, span_id, payload::text",
        "agents": "*",
        "agent_sequences": "*",
        "runs": "run_id, attributes::text, recorded_at, trace_id, root_span_id",
        "spans": "run_id, trace_id, span_id, parent_span_id, name, kind, start_time, end_time,"
        " status_code, status_message, service_name, scope_name, recorded_at",
        "record_conflicts": "run_id, conflict_id, agent_id, reason, stored::text, offered::text,"
        " row_digest, detected_at",
        "tool_ledger": "*",
        "spawns": "*",
        "memory": "run_id, memory, key, found, value::text, version, writer_event_id,"
        " writer_seq, writer_agent_id, writer_trace_id, writer_span_id, updated_at",
    }
    return {
        table: {tuple(r) for r in conn.execute(f"SELECT {cols} FROM agentcap.{table}")}
        for table, cols in columns.items()
    }


def test_migration_0006_keeps_every_row_and_invariant(pg_empty_dsn: str) -> None:
    """A log written before 0006 comes out of it with every row of every table unchanged (the
    tool ledger, spawns, memory and record conflicts included), every run with a start (its own,
    else its first event's, else when it was recorded) that all its rows carry in one partition,
    every key led by run_id, updates of events and conflicts refused in every partition, a
    writer that finds every event again, and 0005's functions working on the partitioned log."""
    _at_version(pg_empty_dsn, 5)
    batches = _seed_version_5(pg_empty_dsn)
    with psycopg.connect(pg_empty_dsn) as conn:
        before = _snapshot(conn)
        starts = dict(conn.execute("SELECT run_id, started_at FROM agentcap.runs").fetchall())
        first_events = dict(
            conn.execute("SELECT run_id, min(wall_time) FROM agentcap.events GROUP BY 1")
        )
        max_conflict = conn.execute("SELECT max(conflict_id) FROM agentcap.conflicts").fetchone()
    assert migrate(pg_empty_dsn) == [m.version for m in available_migrations()][5:]
    with psycopg.connect(pg_empty_dsn) as conn:
        after = _snapshot(conn)
        assert all(before[t] for t in ("tool_ledger", "spawns", "memory", "record_conflicts"))
        new_runs = after["runs"] - before["runs"]
        assert {r[0] for r in new_runs} == {"run-3", "root-only"}
        assert after == {**before, "runs": before["runs"] | new_runs}
        stored = dict(conn.execute("SELECT run_id, started_at FROM agentcap.runs").fetchall())
        assert stored["run-3"] == first_events["run-3"]
        assert stored["run-5"] == first_events["run-5"]
        assert stored["root-only"] == datetime(2025, 3, 3, tzinfo=UTC)
        assert stored["empty"] == datetime(2025, 2, 2, tzinfo=UTC)
        assert all(stored[r] == s for r, s in starts.items() if s is not None)
        for table, runs in (("events", 10), ("conflicts", 10), ("spans", 11)):
            rows = conn.execute(
                f"SELECT x.run_id, count(DISTINCT x.tableoid), bool_and(x.run_started_at ="
                f" r.started_at) FROM agentcap.{table} x JOIN agentcap.runs r USING (run_id)"
                f" GROUP BY 1"
            ).fetchall()
            assert len(rows) == runs and all(r[1:] == (1, True) for r in rows), rows
        keys = {
            name: definition
            for name, definition in conn.execute(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
                " WHERE conrelid IN ('agentcap.events'::regclass, 'agentcap.conflicts'::regclass,"
                " 'agentcap.spans'::regclass) AND contype IN ('p', 'u')"
            )
        }
        assert keys == {
            "events_pkey": "PRIMARY KEY (run_id, run_started_at, event_id)",
            "events_run_agent_seq_key": "UNIQUE (run_id, run_started_at, agent_id, logical_seq)",
            "events_run_agent_idempotency_key": (
                "UNIQUE (run_id, run_started_at, agent_id, idempotency_key)"
            ),
            "conflicts_pkey": "PRIMARY KEY (run_id, run_started_at, conflict_id)",
            "spans_pkey": "PRIMARY KEY (run_id, run_started_at, trace_id, span_id)",
        }
        unique_indexes = [
            r[0]
            for r in conn.execute(
                "SELECT pg_get_indexdef(indexrelid) FROM pg_index"
                " WHERE indrelid IN ('agentcap.events'::regclass, 'agentcap.conflicts'::regclass)"
                " AND indisunique"
            )
        ]
        assert all("(run_id, run_started_at" in d for d in unique_indexes), unique_indexes
        every_key = conn.execute(
            "SELECT c.relname, pg_get_indexdef(x.indexrelid) FROM pg_index x"
            " JOIN pg_class c ON c.oid = x.indrelid"
            " WHERE c.relnamespace = 'agentcap'::regnamespace AND x.indisunique"
            " AND NOT c.relispartition AND c.relname NOT IN"
            " ('runs', 'pruned_runs', 'schema_version', 'roles', 'log_settings')"
        ).fetchall()
        assert {"tool_ledger", "spawns", "memory", "record_conflicts"} <= {t for t, _ in every_key}
        assert all(" (run_id" in d for _, d in every_key), every_key
        updated = 0
        for table in ("events", "conflicts"):
            for partition, triggers, size in conn.execute(
                "SELECT p.partition::text, (SELECT count(*) FROM pg_trigger t"
                "  WHERE t.tgrelid = p.partition AND t.tgname = %s),"
                " pg_relation_size(p.partition) FROM agentcap.log_partitions(%s::regclass) p",
                (f"{table}_append_only", f"agentcap.{table}"),
            ).fetchall():
                assert triggers == 1, partition  # 0004's trigger, on every partition
                if not size:
                    continue  # empty: no row for a row trigger to refuse
                updated += 1
                with pytest.raises(psycopg.errors.InsufficientPrivilege), conn.transaction():
                    conn.execute(f"UPDATE {partition} SET wall_time = wall_time")
        assert updated >= 6
        assert orphans(conn) == dict.fromkeys(orphans(conn), 0)
    with ConnectionPool(pg_empty_dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        for batch in batches:
            again = writer.write(Batch(batch.events))
            assert (again.inserted, again.duplicates, again.conflicts) == (0, len(batch.events), 0)
        twin = batches[0].events[2]._replace(idempotency_key="twin", payload={"twin": True})
        twin = twin._replace(event_id=event_id_for(twin.run_id, twin.agent_id, "twin"))
        assert writer.write(Batch((twin,))).conflicts == 1
        writer.close()
    with psycopg.connect(pg_empty_dsn) as conn:
        newest = conn.execute(
            "SELECT conflict_id FROM agentcap.conflicts WHERE idempotency_key = 'twin'"
        ).fetchone()
    assert max_conflict is not None and newest == (max_conflict[0] + 1,)
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        # The memory of run-2 goes on: its next write names the migrated one as its parent, and
        # its event lands in the run's partition; a spawn an earlier version exported is found.
        conn.execute(
            "SELECT * FROM agentcap.memory_write('run-2', 'notes', 'k2', 'set', true, '3'::jsonb,"
            " NULL, 'coordinator', %s, 1100, '2025-06-01', NULL, NULL, NULL)",
            (event_id_for("run-2", "coordinator", "seq:1100"),),
        )
        event = conn.execute(
            "SELECT e.causal_parent_ids, e.run_started_at = r.started_at FROM agentcap.events e"
            " JOIN agentcap.runs r USING (run_id)"
            " WHERE e.run_id = 'run-2' AND e.event_type = 'memory_write'"
            " ORDER BY e.logical_seq DESC LIMIT 1"
        ).fetchone()
        spawn = batches[4].agents[1]
        found = conn.execute(
            "SELECT won, spawn_event_id::text FROM agentcap.spawn_register(%s, %s, 'planner',"
            " NULL, NULL, gen_random_uuid(), 99, NULL, NULL)",
            (spawn.run_id, spawn.agent_id),
        ).fetchone()
    assert event is not None and event[1] is True and len(event[0]) == 1
    assert found == (False, spawn.spawned_at_event_id)


def test_migration_0006_waits_for_a_writer_of_an_earlier_version(pg_empty_dsn: str) -> None:
    """A writer of version 5 that has not committed its events when 0006 starts: the migration
    waits for it and carries its rows into the partitioned log."""
    _at_version(pg_empty_dsn, 5)
    with psycopg.connect(pg_empty_dsn) as writer:
        writer.execute(
            "INSERT INTO agentcap.runs (run_id, started_at) VALUES ('late', '2025-04-04')"
        )
        writer.execute(
            _V2_EVENT,
            (
                uuid.uuid4(),
                "late",
                "a",
                0,
                datetime(2025, 4, 4, tzinfo=UTC),
                "agent_start",
                [],
                "seq:0",
                None,
                None,
                None,
            ),
        )
        with ThreadPoolExecutor(1) as pool:
            migrating = pool.submit(migrate, pg_empty_dsn)
            time.sleep(1.0)  # the migration now waits for this transaction
            assert not migrating.done()
            writer.commit()
            assert migrating.result(timeout=60) == [m.version for m in available_migrations()][5:]
    with psycopg.connect(pg_empty_dsn) as conn:
        row = conn.execute(
            "SELECT tableoid::regclass::text, run_started_at FROM agentcap.events"
        ).fetchone()
    assert row == ("agentcap.events_p20250401", datetime(2025, 4, 4, tzinfo=UTC))


@pytest.mark.parametrize("usage", [False, True])
def test_an_empty_schema_of_another_role_says_what_is_wrong_and_what_to_do(pg_empty_dsn, usage):
    """An empty agentcap schema that another role owns (created by hand), which the migrating
    role may not create tables in (without or with USAGE on it): the error says so and names the
    fixes (migrate as its owner, ALTER SCHEMA ... OWNER TO, GRANT USAGE, CREATE, another
    database), not to take a role of `db grant`, which cannot help an empty schema."""
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    tag = uuid.uuid4().hex[:10]
    owner, login, password = f"ac_other_{tag}", f"ac_App_{tag}", uuid.uuid4().hex
    with psycopg.connect(pg_empty_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(owner)))
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(login), sql.Literal(password)
            )
        )
        dbname = sql.Identifier(admin.info.dbname)
        admin.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(dbname, sql.Identifier(login))
        )
        admin.execute(
            sql.SQL("CREATE SCHEMA agentcap AUTHORIZATION {}").format(sql.Identifier(owner))
        )
        if usage:
            admin.execute(
                sql.SQL("GRANT USAGE ON SCHEMA agentcap TO {}").format(sql.Identifier(login))
            )
    try:
        with pytest.raises(MigrationError) as info:
            migrate(make_conninfo(pg_empty_dsn, user=login, password=password))
        message = str(info.value)
        assert f"the agentcap schema is empty and belongs to role '{owner}'" in message
        assert f"run `otel-agentcap db migrate` as '{owner}'" in message
        assert f'ALTER SCHEMA agentcap OWNER TO "{login}"' in message
        assert f'GRANT USAGE, CREATE ON SCHEMA agentcap TO "{login}"' in message
        assert "use another database" in message
        assert "db grant" not in message
    finally:
        with psycopg.connect(pg_empty_dsn, autocommit=True) as admin:
            admin.execute("DROP SCHEMA agentcap CASCADE")
            for role in (owner, login):
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_the_advice_for_a_schema_of_another_role_quotes_a_role_named_like_a_keyword(
    pg_empty_dsn,
):
    """The SQL the error about another role's empty agentcap schema suggests names a migrating
    role called "analyse" (a reserved word) quoted, as PostgreSQL's quote_ident spells it: the
    unquoted name is a syntax error there."""
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    owner, login, password = f"ac_other_{uuid.uuid4().hex[:10]}", "analyse", uuid.uuid4().hex
    with psycopg.connect(pg_empty_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(owner)))
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(login), sql.Literal(password)
            )
        )
        admin.execute(
            sql.SQL("CREATE SCHEMA agentcap AUTHORIZATION {}").format(sql.Identifier(owner))
        )
    try:
        with pytest.raises(MigrationError) as info:
            migrate(make_conninfo(pg_empty_dsn, user=login, password=password))
        message = str(info.value)
        assert 'ALTER SCHEMA agentcap OWNER TO "analyse"' in message
        assert 'GRANT USAGE, CREATE ON SCHEMA agentcap TO "analyse"' in message
    finally:
        with psycopg.connect(pg_empty_dsn, autocommit=True) as admin:
            admin.execute("DROP SCHEMA agentcap CASCADE")
            for role in (owner, login):
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
