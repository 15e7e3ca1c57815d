"""One PostgreSQL database as the exporter and the sequence source share it: a connection pool,
opened without waiting (so configuration works while the server is still down), and the schema
migrated once, on first use."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from opentelemetry.instrumentation.utils import suppress_instrumentation
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.errors import ConnectionFailed
from otel_agentcap.exporters.postgres.migrate import migrate

_logger = logging.getLogger(__name__)

ENV_DSN: Final = "AGENTCAP_DSN"


def resolve_dsn(dsn: str | None = None, *, announce: bool = True) -> str:
    """The DSN to use: the argument, else ``AGENTCAP_DSN``, else the embedded server (started or
    reused), whose location is printed to stderr when ``announce`` is true."""
    if dsn:
        return dsn
    env = os.environ.get(ENV_DSN)
    if env:
        return env
    resolved = embedded.start()
    if announce:
        print(
            f"otel-agentcap: using the embedded PostgreSQL in {embedded.default_data_dir()} "
            f"({resolved}); set {ENV_DSN} to use another server",
            file=sys.stderr,
        )
    return resolved


@contextmanager
def instrumentation_suppressed() -> Iterator[None]:
    """Run storage I/O without tracing it (an instrumented psycopg would otherwise feed the
    exporter spans of its own writes)."""
    with suppress_instrumentation():
        yield


class Database:
    """A pool on ``dsn`` whose schema is migrated before first use."""

    def __init__(self, dsn: str, *, max_size: int = 4, name: str = "agentcap") -> None:
        self.dsn = dsn
        self.pool: ConnectionPool[Any] = ConnectionPool(
            dsn,
            min_size=1,
            max_size=max_size,
            open=False,
            name=name,
            kwargs={"autocommit": False},
            reconnect_timeout=0,  # never give up reconnecting; callers have their own timeouts
        )
        self.pool.open(wait=False)
        self._schema_ready = False
        self._lock = threading.Lock()
        self._down_until = 0.0

    @contextmanager
    def quick_connection(self, timeout: float = 2.0, cooldown: float = 5.0) -> Iterator[Any]:
        """A pooled connection for a short query on the capture path (inside agent code).

        Fails fast with ConnectionFailed for ``cooldown`` seconds after a failure, so a server
        that is down costs one timeout, not one per captured operation; runs with
        instrumentation suppressed so the query itself is not traced.
        """
        if time.monotonic() < self._down_until:
            raise ConnectionFailed("PostgreSQL was unreachable moments ago")
        try:
            with instrumentation_suppressed():
                self.ensure_schema(timeout)
                with self.pool.connection(timeout=timeout) as conn:
                    yield conn
        except Exception:
            self._down_until = time.monotonic() + cooldown
            raise

    @contextmanager
    def coordination(self, timeout: float = 2.0, cooldown: float = 5.0) -> Iterator[Any]:
        """A pooled connection in autocommit mode, for one statement on the capture path that
        coordinates processes (tool ledger, spawn registry, shared memory): one round trip per
        statement, no BEGIN or COMMIT of its own.

        Like :meth:`quick_connection` it fails fast for ``cooldown`` seconds after the server was
        unreachable, but only connection failures start that cool-down, not an error of the
        statement. Runs with instrumentation suppressed."""
        if time.monotonic() < self._down_until:
            raise ConnectionFailed("PostgreSQL was unreachable moments ago")
        with instrumentation_suppressed():
            try:
                self.ensure_schema(timeout)
                conn = self.pool.getconn(timeout=timeout)
            except PoolTimeout as exc:
                # Every connection busy is load, not an outage: no cool-down then.
                if not self.pool.get_stats().get("pool_size", 0):
                    self._down_until = time.monotonic() + cooldown
                raise ConnectionFailed(f"no database connection within {timeout} s: {exc}") from exc
            except (psycopg.OperationalError, ConnectionFailed) as exc:
                self._down_until = time.monotonic() + cooldown
                if isinstance(exc, ConnectionFailed):
                    raise
                raise ConnectionFailed(f"no database connection: {exc}") from exc
            try:
                conn.autocommit = True
                yield conn
            except psycopg.OperationalError as exc:
                self._down_until = time.monotonic() + cooldown
                raise ConnectionFailed(f"database connection failed: {exc}") from exc
            finally:
                if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                    conn.autocommit = False
                self.pool.putconn(conn)

    def ensure_schema(self, timeout: float = 5.0) -> None:
        """Migrate once per process; raises ConnectionFailed while the server is unreachable
        (after at most ``timeout`` seconds of trying to connect; libpq counts whole seconds, at
        least 2)."""
        if self._schema_ready:
            return
        with self._lock:
            if self._schema_ready:
                return
            connect_timeout = max(2, math.ceil(timeout))
            try:
                with psycopg.connect(
                    self.dsn, connect_timeout=connect_timeout, autocommit=True
                ) as conn:
                    migrate(conn)
            except psycopg.OperationalError as exc:
                raise ConnectionFailed(f"cannot reach PostgreSQL: {exc}") from exc
            self._schema_ready = True

    def close(self) -> None:
        self.pool.close()
