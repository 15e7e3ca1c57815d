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
from psycopg import ClientCursor
from psycopg_pool import ConnectionPool, PoolTimeout

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.connection import (
    SmallPool,
    check_not_closed_by_server,
    closed_by_server,
    first_line,
)
from otel_agentcap.exporters.postgres.errors import ConnectionFailed
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.partitions import ensure_ahead
from otel_agentcap.exporters.postgres.store import limit_lock_waits
from otel_agentcap.forks import call_in_child_after_fork

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


class _OwnPoolFailures(logging.Filter):
    """Keeps psycopg_pool's line per failed connection attempt of agentcap's own pools out of
    the log: the exporter reports an unreachable server itself, once per outage (``FaultLog``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING or not record.args:
            return True
        name = record.args[0] if isinstance(record.args, tuple) else None
        return not (
            isinstance(name, str)
            and name.startswith(_POOL_PREFIX)
            and record.msg
            in ("error connecting in %r: %s", "reconnection attempt in pool %r failed after %s sec")
        )


_POOL_PREFIX: Final = "agentcap"
#: Pools a forked child inherited: kept referenced, never closed (they are the parent's).
_left_in_parent: list[object] = []
_pool_filter_installed = False
_pool_filter_lock = threading.Lock()


def _install_pool_filter() -> None:
    global _pool_filter_installed
    with _pool_filter_lock:
        if not _pool_filter_installed:
            logging.getLogger("psycopg.pool").addFilter(_OwnPoolFailures())
            _pool_filter_installed = True


def _cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was raised from) a statement cancelled at the statement timeout."""
    seen: BaseException | None = exc
    for _ in range(8):  # the wrappers of the query functions, a few levels at most
        if seen is None:
            return False
        if isinstance(seen, psycopg.errors.QueryCanceled):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def answer_lost(exc: BaseException) -> bool:
    """Whether ``exc``, raised by :meth:`Database.coordination` for a statement that was sent,
    leaves the statement's commit unknown: the connection broke (or the server ended the session)
    before its answer was read. A statement cancelled at the statement timeout was rolled back.
    The caller must know the statement was sent: a connection that could not be made raises the
    same way."""
    cause = exc.__cause__ if isinstance(exc, ConnectionFailed) else None
    return isinstance(cause, psycopg.OperationalError) and not isinstance(
        cause, psycopg.errors.QueryCanceled
    )


def rows_waiting_for_locks_at_most(
    conn: psycopg.Connection[Any], database: Database, query: bytes, params: Any
) -> list[tuple[Any, ...]]:
    """The rows of ``query`` on a coordination connection of ``database``, run with a lock
    timeout below its statement timeout: a statement that waits for a lock another session holds
    (a ``LOCK TABLE``, a slow commit) gives up as ``psycopg.errors.LockNotAvailable``, not as a
    cancelled statement, which would take the coordination statements (tool ledger, spawn
    registry, memory) out of use for a cool-down as if the server were hung."""
    milliseconds = max(1, int(database.quick_timeout * 750))
    cursor = ClientCursor(conn)
    cursor.execute(b"SET LOCAL lock_timeout = %d; " % milliseconds + query, params)
    cursor.nextset()  # past the result of the SET, to the statement's
    rows: list[tuple[Any, ...]] = cursor.fetchall()
    return rows


class Database:
    """One database: its DSN, the schema migrated once, and pools opened on first use.

    Each use has a pool of its own, so none waits for another's connections (the exporter's
    writers have connections of their own too):

    * :attr:`pool` serves general use (the OTLP ingest's writer, imports).
    * :meth:`quick_connection` serves the short queries on the capture path (sequence blocks,
      spawn lookups, run claims) from a small pool (``connection.SmallPool``: no background
      threads, nothing logged per failed attempt).
    * :meth:`coordination` serves the statements processes coordinate with (tool ledger, spawn
      registry, shared memory), in autocommit mode.

    Statements on the last two time out after ``quick_timeout`` seconds, so a hung server or a
    lock never holds an agent's thread longer than that. With ``lock_timeout`` (seconds), the
    statements of :attr:`pool` and of the schema check (:meth:`ensure_schema`) give up waiting
    for a lock another session holds (a ``LOCK TABLE``, a migration, other DDL) after that long:
    the writer raises ``LockWaitTimeout`` then, a migration ``MigrationError`` (both
    ``AgentCapStorageError``); None waits without limit.
    """

    def __init__(
        self,
        dsn: str,
        *,
        max_size: int = 4,
        name: str = _POOL_PREFIX,
        quick_timeout: float = 2.0,
        lock_timeout: float | None = None,
    ) -> None:
        if lock_timeout is not None and lock_timeout < 0:
            raise ValueError("lock_timeout must not be negative")
        self.dsn = dsn
        self._lock_timeout = lock_timeout
        self._max_size = max_size
        self._name = name
        self._quick_timeout = quick_timeout
        self._pool: ConnectionPool[Any] | None = None
        self._quick_pool: SmallPool | None = None
        self._coordination_pool: ConnectionPool[Any] | None = None
        self._schema_ready = False
        self._ahead_done = False
        self._lock = threading.Lock()
        self._ahead_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._down_until = 0.0
        # Until when the capture path's queries fail fast after one of them was cancelled (see
        # quick_connection); the coordination statements do not look at it.
        self._quick_down_until = 0.0
        self._closed = False
        _install_pool_filter()
        call_in_child_after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        """A forked child must not use its parent's pools (their threads are gone, their
        connections are the parent's): it opens its own on first use."""
        if self._pool is not None:
            _left_in_parent.append(self._pool)
        if self._coordination_pool is not None:
            _left_in_parent.append(self._coordination_pool)
        if self._quick_pool is not None:
            self._quick_pool.forget()
            _left_in_parent.append(self._quick_pool)
        self._pool = self._quick_pool = self._coordination_pool = None
        self._lock = threading.Lock()
        self._ahead_lock = threading.Lock()
        self._pool_lock = threading.Lock()

    def _limit_lock_waits(self, conn: psycopg.Connection[Any]) -> None:
        if self._lock_timeout is not None:
            limit_lock_waits(conn, self._lock_timeout)

    def _open_pool(
        self, name: str, *, check: bool = True, limit_locks: bool = False, **kwargs: Any
    ) -> ConnectionPool[Any]:
        pool: ConnectionPool[Any] = ConnectionPool(
            self.dsn,
            min_size=1,
            max_size=self._max_size,
            open=False,
            name=name,
            kwargs={"autocommit": False, **kwargs},
            reconnect_timeout=0,  # a failed connection attempt is not retried in the background
            # A connection the server closed while idle is replaced, no round trip; the pool
            # waits a backoff before it tries another (see coordination() for the capture path).
            check=check_not_closed_by_server if check else None,
            configure=self._limit_lock_waits if limit_locks else None,
        )
        pool.open(wait=False)
        return pool

    @property
    def pool(self) -> ConnectionPool[Any]:
        """The general pool (opened on first use)."""
        pool = self._pool
        if pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = self._open_pool(self._name, limit_locks=True)
                pool = self._pool
        return pool

    def _coordination(self) -> ConnectionPool[Any]:
        pool = self._coordination_pool
        if pool is None:
            with self._pool_lock:
                if self._coordination_pool is None:
                    self._coordination_pool = self._open_pool(
                        f"{self._name}-coordination",
                        check=False,  # coordination() replaces closed ones without a backoff
                        autocommit=True,
                        options=f"-c statement_timeout={self._statement_timeout_ms}",
                        application_name="otel-agentcap-coordination",
                    )
                pool = self._coordination_pool
        return pool

    @property
    def quick_timeout(self) -> float:
        """Seconds after which a statement of :meth:`quick_connection` or :meth:`coordination`
        is cancelled."""
        return self._quick_timeout

    @property
    def _statement_timeout_ms(self) -> int:
        return max(1, int(self._quick_timeout * 1000))

    def _quick(self) -> SmallPool:
        pool = self._quick_pool
        if pool is None:
            with self._pool_lock:
                if self._quick_pool is None:
                    self._quick_pool = SmallPool(
                        self.dsn,
                        size=self._max_size,
                        options=f"-c statement_timeout={self._statement_timeout_ms}",
                        application_name="otel-agentcap-capture",
                        on_broken=self._server_closed_connections,
                    )
                pool = self._quick_pool
        return pool

    @contextmanager
    def quick_connection(self, timeout: float = 2.0, cooldown: float = 5.0) -> Iterator[Any]:
        """A pooled connection for a short query on the capture path (inside agent code).

        Fails fast with ConnectionFailed for ``cooldown`` seconds after a failure, so a server
        that is down costs one timeout, not one per captured operation; a statement on it is
        cancelled after the database's ``quick_timeout``; runs with instrumentation suppressed
        so the query itself is not traced.

        A query cancelled at the statement timeout (a lock another session holds, such as the
        retention barrier of ``db prune``, or a hung server) starts the cool-down of the capture
        path only: the coordination statements (tool ledger, spawn registry, memory) tell a
        lock wait from an outage themselves, and a tool call must not run without the ledger
        because a sequence reservation waited for a lock.
        """
        if time.monotonic() < max(self._down_until, self._quick_down_until):
            raise ConnectionFailed("PostgreSQL was unreachable moments ago")
        if self._closed:
            raise ConnectionFailed("the database handle is closed")
        try:
            with instrumentation_suppressed():
                self.ensure_schema(timeout, partitions_ahead=False)
                with self._quick().connection(timeout=timeout) as conn:
                    yield conn
        except Exception as exc:
            if _cancelled(exc):
                self._quick_down_until = time.monotonic() + cooldown
            else:
                self._down_until = time.monotonic() + cooldown
            raise

    @contextmanager
    def coordination(
        self, timeout: float = 2.0, cooldown: float = 5.0, *, after_failure: bool = False
    ) -> Iterator[Any]:
        """A pooled connection in autocommit mode, for one statement on the capture path that
        coordinates processes (tool ledger, spawn registry, shared memory): one round trip per
        statement, no BEGIN or COMMIT of its own. Its pool is its own (see the class), and a
        statement on it is cancelled after ``quick_timeout`` seconds.

        Like :meth:`quick_connection` it fails fast for ``cooldown`` seconds after the server was
        unreachable (or a statement was cancelled: the server is hung or a lock held), but an
        error of the statement itself does not start that cool-down. Runs with instrumentation
        suppressed.

        ``after_failure`` is for the statement that finds out what a statement whose connection
        just broke did (it may have committed before its answer was lost): it does not fail fast
        during the cool-down, and when it succeeds (the server answered on a new connection) the
        cool-down ends."""
        if time.monotonic() < self._down_until and not after_failure:
            raise ConnectionFailed("PostgreSQL was unreachable moments ago")
        if self._closed:
            raise ConnectionFailed("the database handle is closed")
        with instrumentation_suppressed():
            try:
                self.ensure_schema(timeout, partitions_ahead=False)
                pool = self._coordination()  # this one, also when close() drops it meanwhile
                deadline = time.monotonic() + timeout
                conn = pool.getconn(timeout=timeout)
                if closed_by_server(conn):
                    # The server closed it while it was idle (idle_session_timeout, a restart,
                    # a proxy's idle timeout), and likely the pool's other idle ones with it:
                    # seen without a round trip, so this statement takes a connection of a new
                    # pool instead of failing (the old pool is closed with what it holds).
                    conn.close()
                    self._discard_coordination(pool)
                    quick = self._quick_pool
                    if quick is not None:
                        quick.drop_idle()
                    pool = self._coordination()
                    conn = pool.getconn(timeout=max(0.0, deadline - time.monotonic()))
            except PoolTimeout as exc:
                # Every connection busy is load, not an outage: no cool-down then.
                if not pool.get_stats().get("pool_size", 0):
                    self._down_until = time.monotonic() + cooldown
                raise ConnectionFailed(f"no database connection within {timeout} s: {exc}") from exc
            except (psycopg.OperationalError, ConnectionFailed) as exc:
                self._down_until = time.monotonic() + cooldown
                if isinstance(exc, ConnectionFailed):
                    raise
                raise ConnectionFailed(f"no database connection: {exc}") from exc
            try:
                yield conn
                if after_failure:
                    self._down_until = 0.0
            except psycopg.OperationalError as exc:
                self._down_until = time.monotonic() + cooldown
                if conn.broken:
                    # The server closed the connection (a restart, say): the pool's other idle
                    # connections are from before it too, and each would fail its next statement
                    # and start a cool-down of its own. A new pool connects afresh.
                    self._discard_coordination(pool)
                    quick = self._quick_pool
                    if quick is not None:
                        quick.drop_idle()
                raise ConnectionFailed(f"database connection failed: {first_line(exc)}") from exc
            finally:
                pool.putconn(conn)

    def _server_closed_connections(self) -> None:
        """A capture-path connection was closed by the server: the coordination pool's are from
        before that too (the quick pool drops its own)."""
        pool = self._coordination_pool
        if pool is not None:
            self._discard_coordination(pool)

    def _discard_coordination(self, pool: ConnectionPool[Any]) -> None:
        """Replace the coordination pool whose connection the server closed; the old one is
        closed on a thread of its own (closing waits for its workers), its connections in use are
        closed when they are returned."""
        with self._pool_lock:
            if self._coordination_pool is not pool:
                return
            self._coordination_pool = None
        threading.Thread(
            target=pool.close,
            kwargs={"timeout": 1.0},
            name="agentcap-discard-pool",
            daemon=True,
        ).start()

    @property
    def schema_ready(self) -> bool:
        return self._schema_ready

    def forget_schema(self) -> None:
        """Check (and migrate) the schema again before the next use: a table was found missing."""
        self._schema_ready = False

    def ensure_schema(self, timeout: float = 5.0, *, partitions_ahead: bool = True) -> None:
        """Migrate once per process; raises ConnectionFailed while the server is unreachable
        (after at most ``timeout`` seconds of trying to connect; libpq counts whole seconds, at
        least 2). With ``partitions_ahead`` (the exporter's and the ingest's writers), also
        create the partitions of this and the next interval once per process; the capture path
        leaves that out, since it may wait for a lock on the log (a write creates a missing
        partition anyway)."""
        if not self._schema_ready:
            with self._lock:
                if not self._schema_ready:
                    connect_timeout = max(2, math.ceil(timeout))
                    try:
                        with psycopg.connect(
                            self.dsn, connect_timeout=connect_timeout, autocommit=True
                        ) as conn:
                            self._limit_lock_waits(conn)
                            migrate(conn)
                    except psycopg.OperationalError as exc:
                        raise ConnectionFailed(
                            f"cannot reach PostgreSQL: {first_line(exc)}"
                        ) from exc
                    self._schema_ready = True
        if partitions_ahead and not self._ahead_done:
            with self._ahead_lock:
                if not self._ahead_done:
                    self._partitions_ahead(max(2, math.ceil(timeout)))
                    self._ahead_done = True

    def _partitions_ahead(self, connect_timeout: int) -> None:
        """Create the log's partitions for this and the next interval, so the first batches of a
        new month do not wait for one (best effort: a write creates a missing one anyway)."""
        try:
            with psycopg.connect(
                self.dsn, connect_timeout=connect_timeout, autocommit=True
            ) as conn:
                ensure_ahead(conn, 1, lock_timeout=1.0)
        except psycopg.Error as exc:
            _logger.debug("agentcap: partitions not created ahead: %s", exc)

    def close(self) -> None:
        self._closed = True
        with self._pool_lock:
            pool, quick, coordination = self._pool, self._quick_pool, self._coordination_pool
            self._pool = self._quick_pool = self._coordination_pool = None
        if quick is not None:
            quick.close()
        for opened in (coordination, pool):
            if opened is not None:
                opened.close(timeout=1.0)
