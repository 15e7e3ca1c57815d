"""A SQLite file of the queue directory that every process of this host using it shares.

The host's sequence floors (``host_sequences``) and spawns (``host_spawns``) are such files: one
connection per process (opened on first use, thread-safe behind a lock), WAL journal, one table
whose rows untouched for :data:`RETENTION_S` are forgotten when the file is opened. SQLite
connections must not cross a fork: a forked child opens its own and leaves the parent's alone.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import ClassVar, Final

from otel_agentcap.forks import call_in_child_after_fork

#: Rows not touched for this long are forgotten (their runs are long over).
RETENTION_S: Final = 30 * 24 * 3600.0

#: What a forked child inherited and must neither use nor close (it is the parent's).
_left_in_parent: list[object] = []


class HostFile:
    """One process's connection to a host file. Subclasses name the file's table, its schema
    (``CREATE TABLE IF NOT EXISTS``, with an ``updated`` column of Unix times) and how each
    commit is synced (``PRAGMA synchronous``); they hold ``_lock`` while they use
    ``_connection()``."""

    TABLE: ClassVar[str]
    SCHEMA: ClassVar[str]
    SYNCHRONOUS: ClassVar[str]

    def __init__(self, path: Path, *, busy_timeout: float = 10.0) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._busy_timeout = busy_timeout
        self._conn: sqlite3.Connection | None = None
        call_in_child_after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        if self._conn is not None:
            _left_in_parent.append(self._conn)
        self._conn = None
        self._lock = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path,
                timeout=self._busy_timeout,
                isolation_level=None,
                check_same_thread=False,
            )
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={self.SYNCHRONOUS}")
                conn.execute(self.SCHEMA)
                conn.execute(
                    f"DELETE FROM {self.TABLE} WHERE updated < ?", (time.time() - RETENTION_S,)
                )
            except sqlite3.Error:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
