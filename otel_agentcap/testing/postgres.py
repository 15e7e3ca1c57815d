"""pytest plugin: a PostgreSQL server for the session and a fresh, migrated database per test.

Enable with ``pytest_plugins = ["otel_agentcap.testing.postgres"]``. The server is the one named by
``AGENTCAP_TEST_DSN`` (any database on it; the plugin creates and drops its own databases), or else
an embedded server in a temporary directory that is stopped and deleted at the end of the session.
The migrations run once per session, into a template database; each test's database is a copy of
it (``CREATE DATABASE ... TEMPLATE``), which takes a fraction of the time of migrating anew.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import psycopg
import pytest
from psycopg import sql

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.migrate import migrate

ENV_TEST_DSN: Final = "AGENTCAP_TEST_DSN"


def _create_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def _drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def pg_server_dsn() -> Iterator[str]:
    """DSN of a maintenance database (``postgres``) on the session's server."""
    external = os.environ.get(ENV_TEST_DSN)
    if external:
        yield embedded.dsn_for(external, "postgres")
        return
    root = Path(tempfile.mkdtemp(prefix="agentcap-pg-"))
    data_dir = root / "pg"
    try:
        yield embedded.start(data_dir, database="postgres")
    finally:
        embedded.destroy(data_dir)
        root.rmdir() if root.exists() and not any(root.iterdir()) else None


@pytest.fixture(scope="session")
def pg_template_database(pg_server_dsn: str) -> Iterator[str]:
    """Name of a database migrated once for the session, that ``pg_dsn`` copies for each test.

    Nobody may connect to it once migrated (``ALLOW_CONNECTIONS false``): PostgreSQL copies a
    database only while no session is connected to it, autovacuum's included."""
    name = f"agentcap_template_{uuid.uuid4().hex[:16]}"
    _create_database(pg_server_dsn, name)
    try:
        migrate(embedded.dsn_for(pg_server_dsn, name))
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(
                    sql.Identifier(name)
                )
            )
        yield name
    finally:
        _drop_database(pg_server_dsn, name)


@pytest.fixture()
def pg_dsn(pg_server_dsn: str, pg_template_database: str) -> Iterator[str]:
    """DSN of a new database with the agentcap schema migrated, dropped after the test (a copy
    of the session's migrated template: the same schema, functions, partitions and settings)."""
    name = f"agentcap_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(pg_template_database)
            )
        )
    try:
        yield embedded.dsn_for(pg_server_dsn, name)
    finally:
        _drop_database(pg_server_dsn, name)


@pytest.fixture()
def pg_empty_dsn(pg_server_dsn: str) -> Iterator[str]:
    """DSN of a new, empty (not migrated) database, dropped after the test."""
    name = f"agentcap_test_{uuid.uuid4().hex[:16]}"
    _create_database(pg_server_dsn, name)
    try:
        yield embedded.dsn_for(pg_server_dsn, name)
    finally:
        _drop_database(pg_server_dsn, name)
