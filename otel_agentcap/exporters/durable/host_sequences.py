"""Sequence blocks that never collide, also while PostgreSQL is down.

Each agent's clock reserves blocks of sequences in ``agentcap.agent_sequences`` (one atomic
upsert). While the database cannot be reached, blocks come from this host instead: a small
SQLite file in the queue directory (``sequences.sqlite3``) that every process using the directory
shares. It holds, per (run, agent), the end of the highest block any process of this host was
given, by PostgreSQL or offline:

* every reservation from PostgreSQL asks for a block above that end, and records its own end;
* an offline block starts at that end (or above what the clock asks for, if higher), under
  SQLite's write lock, so two processes of the host never get overlapping blocks;
* the first offline block of an outage, for an agent, starts at a random distance above it, at
  most ``MAX_OFFLINE_JUMP`` (2^30): processes of *other* hosts serving the same agent during the
  same outage cannot coordinate with this one, and the random start makes their blocks meet only
  by chance (about ``1024 / 2^30``, one in a million, per pair of blocks); later offline blocks
  continue right above the previous one.

So, per agent: processes on one host never share a sequence, outage or not; processes on several
hosts never do while PostgreSQL answers, and during an outage do only with the probability above,
in which case the second event of the pair is kept in ``agentcap.conflicts``, never lost. A
sequence handed out offline is at most ``MAX_OFFLINE_JUMP`` plus the events captured offline above
the highest sequence this host knew for the agent, and far below 2^63.
"""

from __future__ import annotations

import logging
import secrets
import sqlite3
import time
from typing import Final

from otel_agentcap.exporters.durable.host_file import HostFile
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.protocols import SequenceSource

_logger = logging.getLogger(__name__)
#: The largest random distance between the last block a host knew of and its first offline one.
MAX_OFFLINE_JUMP: Final = 2**30
SEQUENCES_CONDITION: Final = "sequence blocks"

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS floors (
    run_id   TEXT    NOT NULL,
    agent_id TEXT    NOT NULL,
    next_seq INTEGER NOT NULL,
    offline  INTEGER NOT NULL DEFAULT 0,
    updated  REAL    NOT NULL,
    PRIMARY KEY (run_id, agent_id)
)
"""


class RemoteFailed(Exception):
    """The remote source failed; the store handed out an offline block instead."""


class HostSequenceStore(HostFile):
    """The SQLite file of this host's sequence floors (thread-safe; processes share it through
    SQLite's own locking).

    :meth:`reserve` runs the whole reservation (read the floor, ask PostgreSQL, record the block;
    or take an offline block) inside one SQLite write transaction, so the reservations of every
    process of the host are serialised and none can slip between another's read and write.
    """

    TABLE = "floors"
    SCHEMA = _SCHEMA
    SYNCHRONOUS = "FULL"

    def floor(self, run_id: str, agent_id: str) -> int:
        """The end of the highest block this host was given for the agent (0 if none)."""
        with self._lock:
            row = (
                self._connection()
                .execute(
                    "SELECT next_seq FROM floors WHERE run_id = ? AND agent_id = ?",
                    (run_id, agent_id),
                )
                .fetchone()
            )
        return int(row[0]) if row is not None else 0

    def reserve(
        self,
        run_id: str,
        agent_id: str,
        *,
        at_least: int,
        size: int,
        remote: SequenceSource | None,
    ) -> tuple[int, Exception | None]:
        """A block of ``size`` sequences for the agent: from ``remote`` above this host's floor
        when it answers, else an offline one (see the module doc). Returns its start and the
        remote's error when the block is an offline one. Raises ``sqlite3.Error`` when the
        file cannot be used, ``OSError`` when its directory cannot be created (the remote is not
        asked then)."""
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute(
                    "SELECT next_seq, offline FROM floors WHERE run_id = ? AND agent_id = ?",
                    (run_id, agent_id),
                ).fetchone()
                known, offline = (int(row[0]), bool(row[1])) if row is not None else (0, False)
                failure: Exception | None = None
                start = -1
                if remote is not None:
                    try:
                        start = remote.reserve(
                            run_id, agent_id, at_least=max(at_least, known), size=size
                        )
                    except Exception as exc:
                        failure = exc
                else:
                    failure = RemoteFailed("no remote source")
                if failure is not None:
                    start = max(at_least, known)
                    if not offline:
                        start += secrets.randbelow(MAX_OFFLINE_JUMP // size) * size
                conn.execute(
                    "INSERT INTO floors (run_id, agent_id, next_seq, offline, updated) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id, agent_id) DO UPDATE SET "
                    "next_seq = max(next_seq, excluded.next_seq), offline = excluded.offline, "
                    "updated = excluded.updated",
                    (run_id, agent_id, start + size, failure is not None, time.time()),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return start, failure


class HostAwareSequenceSource:
    """A :class:`~otel_agentcap.clock.SequenceSource`: reserves from ``remote`` (PostgreSQL)
    through this host's ``store``, which hands out offline blocks while ``remote`` fails (see
    the module doc). When the store itself cannot be used, reserves from ``remote`` alone."""

    def __init__(
        self, remote: SequenceSource, store: HostSequenceStore, *, faults: FaultLog
    ) -> None:
        self._remote = remote
        self._store = store
        self._faults = faults

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        try:
            start, failure = self._store.reserve(
                run_id, agent_id, at_least=at_least, size=size, remote=self._remote
            )
        except (sqlite3.Error, OSError) as exc:
            self._faults.fault(
                SEQUENCES_CONDITION,
                f"cannot use {self._store.path} ({exc})",
                consequence="blocks come from PostgreSQL alone, with no offline blocks",
            )
            return self._remote.reserve(run_id, agent_id, at_least=at_least, size=size)
        if failure is not None:
            self._faults.fault(
                SEQUENCES_CONDITION,
                f"cannot reserve from PostgreSQL ({failure})",
                consequence=f"blocks are taken offline from {self._store.path}",
            )
        elif self._faults.is_active(SEQUENCES_CONDITION):
            self._faults.recovered(SEQUENCES_CONDITION, detail="blocks come from PostgreSQL again")
        return start
