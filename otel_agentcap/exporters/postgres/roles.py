"""Append-only roles for the event log (``otel-agentcap db grant``).

Three PostgreSQL roles (group roles without login; give them to login roles with ``GRANT``):

- the **owner** owns the ``agentcap`` schema and its tables and functions; migrations run as it
  (or as a superuser);
- the **writer** is what the exporter and the OTLP ingest run as: it may read every table and
  insert into it, and update only what first-writer-wins filling needs (an agent's unknown name
  and lineage, a run's undeclared attributes, the sequence high-water marks in
  ``agent_sequences``), and the state processes of a run share on the capture path (the tool
  ledger's claims and outcomes, the shared memory's values; through the functions that write them,
  which it may execute); it may not update, delete from or truncate ``events``, ``conflicts`` or
  ``record_conflicts``, nor create anything in the schema (it stages batches in a TEMP table);
- the **reader** may only read (the command-line tool, a viewer).

:func:`grant` creates the roles that do not exist, transfers ownership, revokes what anyone else
was granted in the schema and grants exactly the privileges above; it records the role names in
``agentcap.roles``, so ``migrate()`` grants them again on the tables of later migrations. Roles
are cluster-wide; privileges are per database: run it in every database that holds a log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg import sql

DEFAULT_OWNER: Final = "agentcap_owner"
DEFAULT_WRITER: Final = "agentcap_writer"
DEFAULT_READER: Final = "agentcap_reader"

#: What the writer may do on each table. A table of a later migration not listed here gets
#: SELECT and INSERT: a migration that adds a table the writer must update adds it here.
WRITER_PRIVILEGES: Final[Mapping[str, str]] = {
    "runs": "SELECT, INSERT, UPDATE (attributes, attributes_declared, trace_id, root_span_id)",
    "agents": "SELECT, INSERT, UPDATE (name, parent_agent_id, spawned_at_event_id, lineage_known)",
    "events": "SELECT, INSERT",
    "conflicts": "SELECT, INSERT",
    "record_conflicts": "SELECT, INSERT",
    "spans": "SELECT, INSERT",
    "agent_sequences": "SELECT, INSERT, UPDATE",
    "tool_ledger": "SELECT, INSERT, UPDATE",
    "spawns": "SELECT, INSERT",
    "memory": "SELECT, INSERT, UPDATE",
    "schema_version": "SELECT",
    "roles": "SELECT",
    "log_settings": "SELECT",
    "pruned_runs": "SELECT",
}
#: The functions the writer may execute, by name (the others stay the owner's): what the capture
#: path calls (tool_claim, spawn_register, memory_write: migration 0005; tool_unclaim: 0007) and
#: the partitions of the log by run start (migration 0006). ``ensure_partitions`` and ``analyze_partitions`` are
#: SECURITY DEFINER: the writer creates the partition a new run start needs, and has a partition it
#: fills analyzed, as the owner, and nothing else.
WRITER_FUNCTIONS: Final = frozenset(
    {
        "tool_claim",
        "tool_unclaim",
        "spawn_register",
        "memory_write",
        "ensure_partitions",
        "log_partitions",
        "run_partitioned_tables",
        "partition_range",
        "run_start_for_write",
        "analyze_partitions",
    }
)
#: The functions the reader may execute: listing the partitions.
READER_FUNCTIONS: Final = frozenset({"log_partitions", "run_partitioned_tables", "partition_range"})
#: Sequences the writer draws from: ``conflicts.conflict_id`` (a sequence default since the table
#: is partitioned; PostgreSQL 15 and 16 have no identity columns there).
WRITER_SEQUENCES: Final = ("agentcap.conflicts_conflict_id_seq",)
_DEFAULT_WRITER_PRIVILEGES: Final = "SELECT, INSERT"


@dataclass(frozen=True, slots=True)
class Roles:
    """The role names of one log."""

    owner: str = DEFAULT_OWNER
    writer: str = DEFAULT_WRITER
    reader: str | None = DEFAULT_READER

    def names(self) -> list[str]:
        return [n for n in (self.owner, self.writer, self.reader) if n is not None]


def _exists(conn: psycopg.Connection[Any], role: str) -> bool:
    row = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    return row is not None


def _tables(conn: psycopg.Connection[Any]) -> list[str]:
    """The log's tables (a writer's UNLOGGED staging tables are its own)."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'agentcap' AND c.relkind IN ('r', 'p') "
        "AND c.relname NOT LIKE 'staging\\_%' ORDER BY c.relname"
    ).fetchall()
    return [str(r[0]) for r in rows]


def _functions(conn: psycopg.Connection[Any]) -> list[str]:
    rows = conn.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n "
        "ON n.oid = p.pronamespace WHERE n.nspname = 'agentcap' ORDER BY 1"
    ).fetchall()
    return [str(r[0]) for r in rows]


def _apply(conn: psycopg.Connection[Any], roles: Roles) -> None:
    """Ownership and privileges of ``roles`` on the schema as it is now."""
    owner = sql.Identifier(roles.owner)
    writer = sql.Identifier(roles.writer)
    others = [sql.Identifier(n) for n in (roles.writer, roles.reader) if n is not None]
    everyone = sql.SQL(", ").join([sql.SQL("PUBLIC"), *others])
    execute = conn.execute
    execute(sql.SQL("ALTER SCHEMA agentcap OWNER TO {}").format(owner))
    tables = _tables(conn)
    for table in tables:
        execute(
            sql.SQL("ALTER TABLE {} OWNER TO {}").format(sql.Identifier("agentcap", table), owner)
        )
    for function in _functions(conn):
        # regprocedure text is already quoted where needed.
        execute(sql.SQL("ALTER FUNCTION {} OWNER TO {}").format(sql.SQL(function), owner))
    execute(sql.SQL("REVOKE ALL ON SCHEMA agentcap FROM {}").format(everyone))
    execute(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA agentcap FROM {}").format(everyone))
    execute(sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA agentcap FROM {}").format(everyone))
    execute(sql.SQL("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA agentcap FROM {}").format(everyone))
    grantees = sql.SQL(", ").join(others)
    execute(sql.SQL("GRANT USAGE ON SCHEMA agentcap TO {}").format(grantees))
    database = sql.Identifier(_current_database(conn))
    execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(database, grantees))
    # The writer stages each batch in a TEMP table (it may not create tables in agentcap).
    execute(sql.SQL("GRANT TEMPORARY ON DATABASE {} TO {}").format(database, writer))
    for table in tables:
        privileges = WRITER_PRIVILEGES.get(table, _DEFAULT_WRITER_PRIVILEGES)
        execute(
            sql.SQL("GRANT {} ON {} TO {}").format(
                sql.SQL(privileges), sql.Identifier("agentcap", table), writer
            )
        )
    for sequence in WRITER_SEQUENCES:
        if conn.execute("SELECT to_regclass(%s)", (sequence,)).fetchone() != (None,):
            execute(sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(sql.SQL(sequence), writer))
    functions = {
        function: function.split("(", 1)[0].rsplit(".", 1)[-1].strip('"')
        for function in _functions(conn)
    }
    for function, name in functions.items():
        if name in WRITER_FUNCTIONS:
            execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(sql.SQL(function), writer))
    if roles.reader is not None:
        reader = sql.Identifier(roles.reader)
        execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA agentcap TO {}").format(reader))
        for function, name in functions.items():
            if name in READER_FUNCTIONS:
                execute(
                    sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(sql.SQL(function), reader)
                )


def _current_database(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None
    return str(row[0])


def grant(conn: psycopg.Connection[Any], roles: Roles = Roles()) -> list[str]:
    """Set up ``roles`` on the log of ``conn``'s database (migrated first, see ``migrate``);
    returns the roles it created. Run as a superuser, or as a role that may create roles and
    owns the schema. Idempotent: running it again restores exactly these privileges."""
    names = roles.names()
    if len(set(names)) != len(names):
        raise ValueError(f"the owner, writer and reader must be different roles: {names}")
    created: list[str] = []
    with conn.transaction():
        for name in names:
            if not _exists(conn, name):
                conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(name)))
                created.append(name)
        _apply(conn, roles)
        conn.execute("DELETE FROM agentcap.roles")
        conn.execute(
            "INSERT INTO agentcap.roles (kind, role_name) VALUES ('owner', %s), ('writer', %s)",
            (roles.owner, roles.writer),
        )
        if roles.reader is not None:
            conn.execute(
                "INSERT INTO agentcap.roles (kind, role_name) VALUES ('reader', %s)",
                (roles.reader,),
            )
    return created


def recorded_roles(conn: psycopg.Connection[Any]) -> Roles | None:
    """The roles :func:`grant` recorded in this database, or None."""
    row = conn.execute("SELECT to_regclass('agentcap.roles') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return None
    found = {str(k): str(v) for k, v in conn.execute("SELECT kind, role_name FROM agentcap.roles")}
    if "owner" not in found or "writer" not in found:
        return None
    return Roles(found["owner"], found["writer"], found.get("reader"))


def regrant(conn: psycopg.Connection[Any]) -> None:
    """Grant the recorded roles their privileges again (after migrations added tables)."""
    roles = recorded_roles(conn)
    if roles is not None and all(_exists(conn, name) for name in roles.names()):
        _apply(conn, roles)
