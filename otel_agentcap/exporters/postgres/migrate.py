"""Apply the versioned SQL migrations shipped in ``migrations/`` (``NNNN_name.sql``), in order.

A schema that is up to date is recognised with one read of ``agentcap.schema_version``, without
locks or DDL, so a role that may not create anything (the writer role of `otel-agentcap db
grant`) starts on it. Otherwise all pending files are applied in one transaction, without a statement timeout, that
first takes a transaction-level advisory lock with a fixed key, so several processes starting at once
serialise here: the first applies the files, the others then find the versions recorded in
``agentcap.schema_version`` and do nothing. A role that may not apply them gets a
``MigrationError`` that says which versions are missing and who can apply them. After applying
migrations, the privileges of the roles that `otel-agentcap db grant` set up are granted again,
so they cover new tables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final

import psycopg
from psycopg import sql

from .errors import ConnectionFailed, MigrationError

#: Key of the advisory lock held while migrating (the bytes "agcap_mg").
MIGRATION_LOCK_KEY: Final = 0x61676361705F6D67

_FILE_RE: Final = re.compile(r"^(\d{4})_([A-Za-z0-9_]+)\.sql$")

_BOOTSTRAP: Final = sql.SQL(
    """
    CREATE TABLE IF NOT EXISTS agentcap.schema_version (
        version    integer     PRIMARY KEY,
        name       text        NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
    );
    """
)


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql_text: str


def available_migrations() -> list[Migration]:
    """The migration files shipped with the package, sorted by version."""
    folder = resources.files("otel_agentcap.exporters.postgres").joinpath("migrations")
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE_RE.match(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration versions: {versions}")
    return found


def applied_versions(conn: psycopg.Connection[Any]) -> set[int]:
    """Versions recorded in ``agentcap.schema_version`` (empty when the schema does not exist)."""
    row = conn.execute("SELECT to_regclass('agentcap.schema_version') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return set()
    return {int(r[0]) for r in conn.execute("SELECT version FROM agentcap.schema_version")}


def pending_versions(conn: psycopg.Connection[Any]) -> list[int]:
    """The shipped versions not applied yet (read only: no lock, no DDL)."""
    with conn.transaction():
        done = applied_versions(conn)
    return [m.version for m in available_migrations() if m.version not in done]


def _apply(conn: psycopg.Connection[Any]) -> list[int]:
    pending: list[int] | None = None
    applied: list[int] = []
    try:
        pending = pending_versions(conn)
        if not pending:
            return []  # up to date: nothing needs privileges beyond reading schema_version
        with conn.transaction():
            # Without a statement timeout (one the role or database has would cancel a long
            # migration, or the wait for another process's): for this transaction only.
            conn.execute("SET LOCAL statement_timeout = 0")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            row = conn.execute("SELECT to_regnamespace('agentcap') IS NULL").fetchone()
            if row is not None and row[0]:
                conn.execute("CREATE SCHEMA IF NOT EXISTS agentcap")
            conn.execute(_BOOTSTRAP)
            done = applied_versions(conn)
            for migration in available_migrations():
                if migration.version in done:
                    continue
                conn.execute(migration.sql_text.encode("utf-8"))
                conn.execute(
                    "INSERT INTO agentcap.schema_version (version, name) VALUES (%s, %s)",
                    (migration.version, migration.name),
                )
                applied.append(migration.version)
            if applied:
                from .roles import regrant

                regrant(conn)
    except psycopg.errors.InsufficientPrivilege as exc:
        # The catalogs are readable without any privilege on the schema.
        row = conn.execute(_SCHEMA_STATE).fetchone()
        user, spelled, owner, objects, migrated = row if row else ("?", "?", None, 0, True)
        reason = str(exc).strip().splitlines()[0]
        if owner is not None and not migrated:
            raise MigrationError(
                _foreign_schema_advice(user, spelled, owner, objects, reason)
            ) from exc
        if pending is None:
            raise MigrationError(
                f"role {user!r} may not read the agentcap schema ({reason}): give it the "
                "writer or reader role of `otel-agentcap db grant`"
            ) from exc
        raise MigrationError(
            f"the agentcap schema lacks migrations {pending} and role {user!r} may not apply "
            f"them ({reason}): run `otel-agentcap db migrate` as "
            f"{f'its owner {owner!r}' if owner else 'a role that may create the schema'}"
        ) from exc
    return applied


#: Who we are (the name, and as SQL spells it: quoted where it must be, a reserved word too),
#: and the agentcap schema's owner, how many objects it holds and whether it holds
#: agentcap's tables (its ``schema_version``); the owner is NULL when there is no such schema.
_SCHEMA_STATE: Final = """
SELECT current_user, quote_ident(current_user), n.nspowner::regrole::text,
       (SELECT count(*) FROM pg_class c WHERE c.relnamespace = n.oid),
       EXISTS (SELECT 1 FROM pg_class c
               WHERE c.relnamespace = n.oid AND c.relname = 'schema_version')
FROM (SELECT 1) one LEFT JOIN pg_namespace n ON n.nspname = 'agentcap'
"""


def _foreign_schema_advice(user: str, spelled: str, owner: str, objects: int, reason: str) -> str:
    """What to do about an ``agentcap`` schema without agentcap's tables that ``user`` may not
    create them in: it belongs to ``owner`` (another role), created by hand, say. ``spelled``:
    ``user`` as SQL spells it."""
    held = "is empty" if not objects else f"holds {objects} object(s) but no agentcap tables"
    return (
        f"the agentcap schema {held} and belongs to role {owner!r}, and role {user!r} may not "
        f"create the log's tables in it ({reason}). Either run `otel-agentcap db migrate` as "
        f"{owner!r} (or a member of it); or have {owner!r} or a superuser run "
        f"`ALTER SCHEMA agentcap OWNER TO {spelled}` or `GRANT USAGE, CREATE ON SCHEMA agentcap "
        f"TO {spelled}`; or, if that schema is not meant for the event log, use another database "
        "(the log lives in the schema named agentcap)"
    )


def migrate(conn_or_dsn: psycopg.Connection[Any] | str) -> list[int]:
    """Bring the database to the latest schema; return the versions applied by this call.

    Safe to call from several processes at once and any number of times.
    """
    try:
        if isinstance(conn_or_dsn, str):
            try:
                conn = psycopg.connect(conn_or_dsn, autocommit=True)
            except psycopg.OperationalError as exc:
                raise ConnectionFailed(f"cannot connect to run migrations: {exc}") from exc
            with conn:
                return _apply(conn)
        return _apply(conn_or_dsn)
    except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
        # OperationalErrors by SQLSTATE class, but the connection is fine (a cancel, a
        # lock_timeout of the role): the migration was rolled back.
        raise MigrationError(f"migration failed and was rolled back: {exc}") from exc
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"connection lost while migrating: {exc}") from exc
    except psycopg.Error as exc:
        raise MigrationError(f"migration failed and was rolled back: {exc}") from exc
