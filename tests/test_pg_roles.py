"""Append-only roles (``otel-agentcap db grant``): the writer role stores events and cannot
change or remove them; the exporter and the ingest run as it without CREATE."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from opentelemetry.sdk.trace.export import SpanExportResult
from otlp_support import captured, count, forged, post, request_bytes
from psycopg import sql
from psycopg.conninfo import make_conninfo

from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.exporters.postgres.errors import MigrationError
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.roles import Roles, grant
from otel_agentcap.exporters.postgres.sequences import reserve_sequence_block
from otel_agentcap.ingest import OtlpIngestServer

pytestmark = pytest.mark.storage


@dataclass(frozen=True)
class Granted:
    roles: Roles
    admin_dsn: str
    writer_dsn: str
    reader_dsn: str


def _drop_roles(dsn: str, names: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        existing = [
            n
            for n in names
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (n,)).fetchone()
        ]
        if not existing:
            return
        roles = sql.SQL(", ").join(sql.Identifier(n) for n in existing)
        conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(roles))
        conn.execute(sql.SQL("DROP OWNED BY {}").format(roles))
        for name in existing:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@pytest.fixture()
def granted(pg_dsn: str) -> Iterator[Granted]:
    """Owner, writer and reader roles with unique names on the test database, and a login role
    for the writer and one for the reader; all dropped afterwards (roles are cluster-wide)."""
    tag = uuid.uuid4().hex[:10]
    roles = Roles(f"ac_owner_{tag}", f"ac_writer_{tag}", f"ac_reader_{tag}")
    logins = {"writer": f"ac_w_login_{tag}", "reader": f"ac_r_login_{tag}"}
    password = uuid.uuid4().hex
    names = [*roles.names(), *logins.values()]
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            grant(conn, roles)
            for kind, login in logins.items():
                conn.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                        sql.Identifier(login),
                        sql.Literal(password),
                        sql.Identifier(roles.writer if kind == "writer" else str(roles.reader)),
                    )
                )
        yield Granted(
            roles,
            pg_dsn,
            make_conninfo(pg_dsn, user=logins["writer"], password=password),
            make_conninfo(pg_dsn, user=logins["reader"], password=password),
        )
    finally:
        _drop_roles(pg_dsn, names)


def test_the_writer_cannot_update_delete_or_truncate_the_log(granted: Granted) -> None:
    """As the writer: events, conflicts and record_conflicts refuse UPDATE, DELETE and TRUNCATE;
    nothing can be created in the schema; a stored agent name cannot be changed even through the
    column it may fill."""
    spans, _ = captured("run-roles")
    exporter = PostgresSpanExporter(granted.writer_dsn)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    statements = [
        f"{verb} agentcap.{table}"
        for table in ("events", "conflicts", "record_conflicts")
        for verb in ("TRUNCATE", "DELETE FROM")
    ] + [
        "UPDATE agentcap.events SET payload = '{}'",
        "UPDATE agentcap.conflicts SET payload = '{}'",
        "UPDATE agentcap.runs SET started_at = now()",
        "CREATE TABLE agentcap.mine (x int)",
        "ALTER TABLE agentcap.events DISABLE TRIGGER events_append_only",
    ]
    with psycopg.connect(granted.writer_dsn, autocommit=True) as conn:
        for statement in statements:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
        with pytest.raises(psycopg.errors.IntegrityConstraintViolation):
            conn.execute("UPDATE agentcap.agents SET name = 'renamed' WHERE agent_id = 'planner'")
    assert count(granted.admin_dsn, "SELECT count(*) FROM agentcap.events") > 0


def test_exporter_ingest_and_sequences_run_as_the_writer(granted: Granted) -> None:
    """The exporter, the ingest and sequence reservations work as the writer role, which has no
    CREATE privilege: every event is stored."""
    with psycopg.connect(granted.writer_dsn) as conn:
        row = conn.execute(
            "SELECT has_database_privilege(current_database(), 'CREATE'),"
            " has_schema_privilege('agentcap', 'CREATE')"
        ).fetchone()
        assert row == (False, False)
        assert reserve_sequence_block(conn, "run-w", "a", at_least=1, size=16) >= 1
    spans, expected = captured("run-exported")
    exporter = PostgresSpanExporter(granted.writer_dsn)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        assert exporter.stats().events_inserted == expected
    finally:
        exporter.shutdown()
    spans, expected = captured("run-ingested")
    with OtlpIngestServer(granted.writer_dsn, port=0) as server:
        assert post(server.endpoint, request_bytes(spans))[0] == 200
    query = "SELECT count(*) FROM agentcap.events WHERE run_id = %s"
    assert count(granted.admin_dsn, query, "run-exported") == expected
    assert count(granted.admin_dsn, query, "run-ingested") == expected
    # Conflicts of both kinds are written as the writer too.
    stored = next(s for s in spans if s.name == "memory_write")
    changed = forged(stored, agentcap__event__payload='{"other": 1}', gen_ai__agent__name="x")
    exporter = PostgresSpanExporter(granted.writer_dsn)
    try:
        assert exporter.export([changed]) is SpanExportResult.SUCCESS
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    assert (stats.conflicts, stats.record_conflicts) == (1, 1)


def test_the_reader_only_reads(granted: Granted) -> None:
    """The reader role can list runs and cannot insert."""
    with psycopg.connect(granted.reader_dsn, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM agentcap.runs").fetchone()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO agentcap.runs (run_id) VALUES ('x')")


def test_a_writer_on_a_schema_behind_fails_clearly(granted: Granted) -> None:
    """When the schema lacks a migration, migrate() as the writer raises a MigrationError that
    names the missing versions and who can apply them, instead of failing on CREATE."""
    with psycopg.connect(granted.admin_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM agentcap.schema_version WHERE version = 3")
    with pytest.raises(MigrationError) as info, psycopg.connect(granted.writer_dsn) as conn:
        migrate(conn)
    message = str(info.value)
    assert "lacks migrations [3]" in message and "otel-agentcap db migrate" in message
    assert granted.roles.owner in message


def test_db_grant_command_is_idempotent(pg_dsn: str) -> None:
    """``otel-agentcap db grant`` creates the roles once and can run again."""
    tag = uuid.uuid4().hex[:10]
    args = ["--owner", f"ac_o_{tag}", "--writer", f"ac_w_{tag}", "--reader", "none"]
    try:
        for expected_created in ([f"ac_o_{tag}", f"ac_w_{tag}"], []):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "otel_agentcap.cli",
                    "db",
                    "grant",
                    "--dsn",
                    pg_dsn,
                    "--json",
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["created"] == expected_created
        with psycopg.connect(pg_dsn) as conn:
            owner = conn.execute(
                "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'agentcap'"
            ).fetchone()
        assert owner == (f"ac_o_{tag}",)
    finally:
        _drop_roles(pg_dsn, [f"ac_o_{tag}", f"ac_w_{tag}"])


def test_tables_of_later_migrations_get_the_recorded_privileges(granted: Granted) -> None:
    """A table a later migration adds is given to the owner, readable and insertable by the
    writer, and readable by the reader, when migrate() grants the recorded roles again."""
    from otel_agentcap.exporters.postgres.roles import regrant

    with psycopg.connect(granted.admin_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE agentcap.later (run_id text PRIMARY KEY)")
        regrant(conn)
        owner = conn.execute(
            "SELECT tableowner FROM pg_tables WHERE schemaname = 'agentcap' AND tablename = 'later'"
        ).fetchone()
    assert owner == (granted.roles.owner,)
    with psycopg.connect(granted.writer_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO agentcap.later VALUES ('r')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM agentcap.later")
    with psycopg.connect(granted.reader_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM agentcap.later").fetchone() == (1,)


def test_the_tool_ledger_spawn_registry_and_memory_run_as_the_writer(granted: Granted) -> None:
    """As the writer: a tool call is claimed and completed in the ledger, a spawn is registered,
    and a PostgresMemory write (with its event) and read succeed; the ledger's rows are the only
    thing it may update besides the memory's values."""
    import otel_agentcap as ac
    from otel_agentcap.capture.agents import set_spawn_registry
    from otel_agentcap.capture.ledger import set_tool_ledger
    from otel_agentcap.exporters.postgres import Database, PostgresMemory
    from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
    from otel_agentcap.exporters.postgres.recovery import PostgresSpawnRegistry

    database = Database(granted.writer_dsn)
    ledger = PostgresToolLedger(database, on_unavailable="raise")
    set_tool_ledger(ledger)
    set_spawn_registry(PostgresSpawnRegistry(database))
    memory = PostgresMemory("m", database=database)

    @ac.tool
    def double(x: int) -> int:
        return 2 * x

    try:
        with ac.run(f"run-writer-{uuid.uuid4().hex[:8]}"), ac.agent("a"):
            assert double.invoke("d", 2) == 4
            child = ac.spawn("helper")
            memory["k"] = {"v": 1}
            assert memory["k"] == {"v": 1}
    finally:
        set_tool_ledger(None)
        set_spawn_registry(None)
        ledger.close()
        database.close()
    assert child.agent_id == "a/helper"
    assert ledger.stats().completions == 1
    assert count(granted.admin_dsn, "SELECT count(*) FROM agentcap.spawns") == 1
    assert count(granted.admin_dsn, "SELECT count(*) FROM agentcap.memory") == 1
    with psycopg.connect(granted.writer_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM agentcap.tool_ledger")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("UPDATE agentcap.spawns SET name = 'x'")


def test_the_writer_withdraws_an_unstarted_claim_it_may_not_delete(granted: Granted) -> None:
    """As the writer, a claim given up before its body started (a cancelled caller) is withdrawn
    through agentcap.tool_unclaim, so an at_most_once call claims it again instead of reading an
    unknown outcome; the writer still cannot delete ledger rows itself."""
    from otel_agentcap.capture.ledger import LedgerCall
    from otel_agentcap.exporters.postgres import Database
    from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger

    database = Database(granted.writer_dsn)
    ledger = PostgresToolLedger(database, on_unavailable="raise")
    call = LedgerCall(
        f"run-unclaim-{uuid.uuid4().hex[:8]}", "a", "w", "work", "0" * 64, "at_most_once"
    )
    try:
        first = ledger.claim(call)
        assert first.state == "claimed"
        ledger.release_unstarted(call, first.attempt)
        again = ledger.claim(call)
        assert (again.state, again.attempt) == ("claimed", 1)
        assert ledger.running_claims() == 1
    finally:
        ledger.close()
        database.close()
    with (
        psycopg.connect(granted.writer_dsn, autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("DELETE FROM agentcap.tool_ledger")


def test_the_writer_extends_the_log_and_only_the_owner_prunes(granted):
    """The writer role stores a run of a month no partition holds yet (the SECURITY DEFINER
    function creates the partition as the owner) and a conflict of it, and lists partitions like
    the reader; it may not prune."""
    from datetime import UTC, datetime

    from pg_log import run_batch
    from psycopg_pool import ConnectionPool

    from otel_agentcap.exporters.postgres import partitions, retention
    from otel_agentcap.exporters.postgres.writer import EventWriter
    from otel_agentcap.model import Batch, event_id_for

    batch = run_batch("april", datetime(2025, 4, 4, tzinfo=UTC))
    twin = batch.events[3]._replace(idempotency_key="twin", payload={"twin": True})
    twin = twin._replace(event_id=event_id_for(twin.run_id, twin.agent_id, "twin"))
    with ConnectionPool(granted.writer_dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        stored = writer.write(batch)
        collided = writer.write(Batch((twin,)))
        writer.close()
    assert stored.inserted == len(batch.events) and collided.conflicts == 1
    april = datetime(2025, 4, 1, tzinfo=UTC)
    for dsn in (granted.writer_dsn, granted.reader_dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert april in {p.lower for p in partitions.list_partitions(conn)}
    with (
        psycopg.connect(granted.writer_dsn, autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        retention.prune(conn, datetime(2025, 5, 1, tzinfo=UTC))


@pytest.mark.fault
@pytest.mark.multiprocess
def test_a_privilege_revoked_from_the_writer_keeps_the_spans_queued(granted, tmp_path):
    """With INSERT on events revoked from the writer role after configure() (an operator's
    mistake), the server refuses every batch whatever its rows: the spans wait in the queue,
    none is set aside as refused, and once the privilege is back every event is stored."""
    from durable_support import log_summary, refused_then_restored

    writer = sql.Identifier(granted.roles.writer)
    with psycopg.connect(granted.admin_dsn, autocommit=True) as conn:
        revoke = sql.SQL("REVOKE INSERT ON agentcap.events FROM {}").format(writer).as_string(conn)
        restore = sql.SQL("GRANT INSERT ON agentcap.events TO {}").format(writer).as_string(conn)
    result = refused_then_restored(
        granted.writer_dsn,
        granted.admin_dsn,
        tmp_path / "queue",
        "run-revoked",
        restore,
        refuse=revoke,
    )
    assert result["first"] is False and result["refused_then"] == 0
    assert result["second"] is True and result["refused"] == 0 and result["retried"] > 0
    summary = log_summary(granted.admin_dsn, "run-revoked")
    assert summary["events"] == 7 and summary["conflicts"] == summary["dangling"] == 0


def test_configure_as_the_reader_fails_at_once(granted, tmp_path):
    """configure() as a role that may not insert into the log (the reader role) is the user's
    to fix: a ConfigurationError naming the role and the writer role to give it, not a process
    whose every span waits in the queue."""
    from otel_agentcap.configure import configure
    from otel_agentcap.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"may not write the event log.*db grant"):
        configure(granted.reader_dsn, queue_dir=tmp_path, set_global=False, instrument=False)
