"""``DedicatedConnection``: one connection for one writer thread, opened on first use and again
after it breaks, with no pool (and no pool's reconnect loop logging each failed attempt)."""

from __future__ import annotations

import contextlib
import math
import re
import select
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from .errors import ConnectionFailed

#: TCP keepalives, so a writer notices a server that vanished (host down, cable cut) within about
#: a minute instead of waiting on a dead socket for the kernel's default two hours.
KEEPALIVES: Final = "keepalives=1 keepalives_idle=30 keepalives_interval=10 keepalives_count=3"


class DedicatedConnection:
    """A connection source with the pool's ``connection(timeout=...)`` shape, for one thread.

    Failing to connect raises :class:`ConnectionFailed` at once (the caller decides when to try
    again); a connection that broke is discarded and the next use connects again.
    """

    def __init__(
        self, dsn: str, *, connect_timeout: float = 5.0, application_name: str = "otel-agentcap"
    ) -> None:
        self._dsn = dsn
        self._connect_timeout = connect_timeout
        self._application_name = application_name
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def _connect(self, timeout: float | None) -> psycopg.Connection[Any]:
        seconds = self._connect_timeout if timeout is None else timeout
        try:
            conninfo = make_conninfo(
                self._dsn,
                connect_timeout=max(2, math.ceil(seconds)),  # libpq: whole seconds, at least 2
                application_name=self._application_name,
            )
            return psycopg.connect(f"{conninfo} {KEEPALIVES}", autocommit=False)
        except psycopg.Error as exc:
            raise ConnectionFailed(
                f"cannot connect to PostgreSQL: {first_line(exc, self._dsn)}"
            ) from exc

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        with self._lock:
            conn = self._conn
            if conn is not None and closed_by_server(conn):
                self._discard()
                conn = None
            if conn is None or conn.closed or conn.broken:
                conn = self._conn = self._connect(timeout)
            try:
                yield conn
            except (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction):
                # Broken, or a server that takes no writes (a standby): connect again, so a
                # multi-host DSN with target_session_attrs=read-write finds the primary.
                self._discard()
                raise
            finally:
                if self._conn is not None and not self._conn.closed:
                    status = self._conn.info.transaction_status
                    if status != pq.TransactionStatus.IDLE:
                        try:
                            self._conn.rollback()
                        except psycopg.Error:
                            self._discard()

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        """Close the connection (waits for a statement another thread is running on it)."""
        with self._lock:
            self._discard()


class SmallPool:
    """At most ``size`` connections, opened on demand and kept while they work, for the short
    queries of the capture path (many threads, rare queries). Unlike ``psycopg_pool`` it has no
    background threads and logs nothing: a failure is raised to the caller, who reports it.
    ``options`` are server settings for every connection (e.g. ``-c statement_timeout=2000``)."""

    def __init__(
        self,
        dsn: str,
        *,
        size: int = 4,
        options: str | None = None,
        application_name: str = "otel-agentcap",
        on_broken: Callable[[], None] | None = None,
    ) -> None:
        self._dsn = dsn
        self._on_broken = on_broken
        self._options = options
        self._application_name = application_name
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, timeout: float) -> psycopg.Connection[Any]:
        extra: dict[str, Any] = {"application_name": self._application_name}
        if self._options:
            extra["options"] = self._options
        conninfo = make_conninfo(self._dsn, connect_timeout=max(2, math.ceil(timeout)), **extra)
        try:
            return psycopg.connect(f"{conninfo} {KEEPALIVES}", autocommit=False)
        except psycopg.Error as exc:
            raise ConnectionFailed(
                f"cannot connect to PostgreSQL: {first_line(exc, self._dsn)}"
            ) from exc

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        seconds = 5.0 if timeout is None else timeout
        if self._closed:
            raise ConnectionFailed("the connection pool is closed")
        if not self._slots.acquire(timeout=seconds):
            raise ConnectionFailed(f"no database connection free within {seconds:.1f} s")
        conn: psycopg.Connection[Any] | None = None
        try:
            with self._lock:
                while self._idle and conn is None:
                    candidate = self._idle.pop()
                    if not closed_by_server(candidate):
                        conn = candidate
                    elif not candidate.closed:
                        with contextlib.suppress(Exception):
                            candidate.close()
            if conn is None:
                conn = self._connect(seconds)
            yield conn
            if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                conn.rollback()
        except BaseException:
            if conn is not None:
                if conn.broken:
                    # The server closed it (a restart, say): the idle ones are from before that
                    # too, and each would fail its next query; connect afresh instead.
                    self.drop_idle()
                    if self._on_broken is not None:
                        self._on_broken()
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None
            raise
        finally:
            if conn is not None:
                with self._lock:
                    if self._closed:
                        conn.close()
                    else:
                        self._idle.append(conn)
            self._slots.release()

    def drop_idle(self) -> None:
        """Close the idle connections (the server closed one of them: the rest are as old)."""
        with self._lock:
            stale, self._idle = self._idle, []
        for conn in stale:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(Exception):
                conn.close()

    def forget(self) -> None:
        """Drop the connections without closing them (a forked child's: they are the parent's)."""
        with self._lock:
            self._idle = []


def closed_by_server(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection was closed by the server (``idle_session_timeout``,
    ``pg_terminate_backend``, a restart; also a proxy's idle timeout), without a round trip: the
    server then sent its error and closed the socket, which makes the socket readable, and the
    socket of an idle connection that nothing LISTENs on is readable for nothing else. A
    connection the network lost silently is not noticed here (TCP keepalives notice it)."""
    if conn.closed or conn.broken:
        return True
    try:
        # poll, not select: select() refuses descriptors from 1024 on, which a process with
        # many files open gives its connections.
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError, psycopg.Error):
        return True


def check_not_closed_by_server(conn: psycopg.Connection[Any]) -> None:
    """The ``check`` of a ``psycopg_pool`` pool: a connection the server closed while it was
    idle in the pool is discarded before it is handed out (see :func:`closed_by_server`)."""
    if closed_by_server(conn):
        conn.close()  # so the pool discards it rather than keep it
        raise psycopg.OperationalError("the server closed the connection while it was idle")


def first_line(exc: BaseException, dsn: str | None = None) -> str:
    """The first line of an error's message (libpq's messages run over several lines), with any
    password it quotes from a DSN replaced (see :func:`without_password`), also one quoted
    alone when ``dsn`` (the DSN the error is about) is given."""
    text = str(exc).strip()
    return without_password(text.splitlines()[0], dsn) if text else type(exc).__name__


#: A password in a DSN: ``scheme://user:PASSWORD@`` or ``password=PASSWORD`` (quoted or not).
_PASSWORD: Final = re.compile(
    r"(?P<uri>postgres(?:ql)?://[^:/@\s\"']*:)[^@\s\"']*(?=@)"
    r"|(?P<key>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s\"']+)",
    re.IGNORECASE,
)


#: The password of a URI as libpq reads it (up to the first ``@`` or ``/``), spaces and quotes
#: included, which :data:`_PASSWORD` leaves out: libpq names such a password alone in its error.
_URI_PASSWORD: Final = re.compile(r"postgres(?:ql)?://[^:@/]*:(?P<password>[^@/]*)@", re.I)
#: A word without ``=`` in a ``key=value`` DSN: libpq quotes it alone, and it is often a
#: password whose ``password=`` was left out.
_BARE_WORD: Final = re.compile(r'(?P<head>missing "=" after ")[^"]*(?=")')


def _passwords_in(dsn: str) -> list[str]:
    found = [m.group("password") for m in _URI_PASSWORD.finditer(dsn)]
    for match in _PASSWORD.finditer(dsn):
        if match.group("key"):
            value = match.group()[len(match.group("key")) :]
            found += [value, value[1:-1]] if value.startswith("'") else [value]
    return sorted({value for value in found if value}, key=len, reverse=True)


def without_password(text: str, dsn: str | None = None) -> str:
    """``text`` (a DSN, or a message quoting one: libpq echoes a URI it cannot parse) with its
    passwords replaced by ``***``, for what is printed or logged. With ``dsn`` (the DSN a
    message is about), its password is replaced wherever the message quotes it, and so is a
    bare word libpq found in it (``missing "=" after "..."``)."""
    if dsn is not None:
        for password in _passwords_in(dsn):
            text = text.replace(password, "***")
        text = _BARE_WORD.sub(lambda m: m.group("head") + "***", text)
    return _PASSWORD.sub(lambda m: (m.group("uri") or m.group("key")) + "***", text)
