"""Spawns that processes of one host agree on, also while PostgreSQL is down.

The spawn registry is ``agentcap.spawns`` (``exporters.postgres.recovery``). While it cannot be
reached, spawns are registered in a small SQLite file in the queue directory
(``spawns.sqlite3``) that every process using the directory shares, with the same rule: the
first registration of a child wins, a later one (a retry of the child in another process of the
host) gets the first one's spawn event and sequence, records nothing, and its child starts above
that sequence. A spawn is registered in the file first, also while PostgreSQL answers, and then
in PostgreSQL (the spawn the file holds, which may be another process's): so the file holds every
spawn the host's processes registered, a retry during an outage finds those too, and a process of
the host that reaches PostgreSQL never overrules one that registered the child in the file a
moment before, while it could not.

A spawn registered in the file only (``registered = 0``) is registered in PostgreSQL:

* by the delivery of its ``agent_spawn`` event, before the event is stored (the span carries
  ``agentcap.spawn.unregistered``; see ``exporters.postgres.exporter``), and
* by the first process of the host that looks the child up in PostgreSQL once it answers and
  does not find it there (a retry of the child before the event was delivered).

Processes of other hosts cannot see the file: a child spawned on two hosts during one outage is
recorded twice, and the delivery that registers second leaves its event out (see the README).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import replace
from typing import Final

from otel_agentcap.exporters.durable.host_file import HostFile
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.exporters.postgres.recovery import is_claimed, span_context_of
from otel_agentcap.model import EventRef
from otel_agentcap.protocols import SpawnClaim, SpawnRecord, SpawnRegistry

SPAWNS_CONDITION: Final = "spawn registry"

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS spawns (
    run_id          TEXT    NOT NULL,
    child_agent_id  TEXT    NOT NULL,
    parent_agent_id TEXT    NOT NULL,
    name            TEXT,
    spawn_key       TEXT,
    spawn_event_id  TEXT    NOT NULL,
    spawn_seq       INTEGER NOT NULL,
    trace_id        TEXT,
    span_id         TEXT,
    registered      INTEGER NOT NULL,
    updated         REAL    NOT NULL,
    PRIMARY KEY (run_id, child_agent_id)
)
"""

_COLUMNS: Final = (
    "run_id, child_agent_id, parent_agent_id, name, spawn_key, spawn_event_id, spawn_seq, "
    "trace_id, span_id"
)


def record_of(claim: SpawnClaim, *, won: bool = False, offline: bool = False) -> SpawnRecord:
    """The spawn record a claim stands for."""
    span = span_context_of(claim.trace_id, claim.span_id)
    return SpawnRecord(
        claim.parent_agent_id,
        claim.name,
        EventRef(claim.spawn_event_id, claim.spawn_seq, claim.parent_agent_id, span),
        span,
        won=won,
        offline=offline,
    )


def claim_of(run_id: str, child_agent_id: str, record: SpawnRecord, key: str | None) -> SpawnClaim:
    """The claim that registers ``record`` as it is (what the file keeps)."""
    span = record.spawn_span
    trace_id = f"{span.trace_id:032x}" if span is not None and span.is_valid else None
    span_id = f"{span.span_id:016x}" if span is not None and span.is_valid else None
    return SpawnClaim(
        run_id,
        child_agent_id,
        record.parent_agent_id,
        record.name or "",
        key,
        record.spawned_at.event_id,
        record.spawned_at.seq,
        trace_id,
        span_id,
    )


class HostSpawnStore(HostFile):
    """The SQLite file of this host's spawns (thread-safe; processes share it through SQLite's
    own locking). Commits are not synced to disk one by one (``synchronous=NORMAL``): they
    survive the end of a process, which is what the processes coordinate over."""

    TABLE = "spawns"
    SCHEMA = _SCHEMA
    SYNCHRONOUS = "NORMAL"

    def find(self, run_id: str, child_agent_id: str) -> tuple[SpawnClaim, bool] | None:
        """The child's spawn as the file holds it, and whether it is registered in PostgreSQL."""
        with self._lock:
            row = (
                self._connection()
                .execute(
                    f"SELECT {_COLUMNS}, registered FROM spawns "
                    "WHERE run_id = ? AND child_agent_id = ?",
                    (run_id, child_agent_id),
                )
                .fetchone()
            )
        if row is None:
            return None
        return SpawnClaim(*row[:9]), bool(row[9])

    def claim(self, claim: SpawnClaim) -> tuple[SpawnClaim, bool, bool]:
        """Insert-or-get ``claim`` (as not registered in PostgreSQL yet): the claim the file
        holds for the child, whether it is this one, and whether it is registered there."""
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    f"INSERT INTO spawns ({_COLUMNS}, registered, updated) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?) ON CONFLICT DO NOTHING",
                    (*claim, time.time()),
                )
                row = conn.execute(
                    f"SELECT {_COLUMNS}, registered FROM spawns "
                    "WHERE run_id = ? AND child_agent_id = ?",
                    (claim.run_id, claim.child_agent_id),
                ).fetchone()
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        held = SpawnClaim(*row[:9])
        mine = (held.spawn_event_id, held.spawn_seq) == (claim.spawn_event_id, claim.spawn_seq)
        return held, mine, bool(row[9])

    def registered(self, claim: SpawnClaim) -> None:
        """Keep ``claim`` as the child's spawn registered in PostgreSQL (it replaces whatever
        the file held: PostgreSQL decides)."""
        with self._lock:
            self._connection().execute(
                f"INSERT INTO spawns ({_COLUMNS}, registered, updated) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?) ON CONFLICT (run_id, child_agent_id) "
                "DO UPDATE SET parent_agent_id = excluded.parent_agent_id, name = excluded.name, "
                "spawn_key = excluded.spawn_key, spawn_event_id = excluded.spawn_event_id, "
                "spawn_seq = excluded.spawn_seq, trace_id = excluded.trace_id, "
                "span_id = excluded.span_id, registered = 1, updated = excluded.updated",
                (*claim, time.time()),
            )


class HostAwareSpawnRegistry:
    """A :class:`~otel_agentcap.protocols.SpawnRegistry`: ``remote`` (PostgreSQL), with this
    host's ``store`` while it fails (see the module doc). Raises the remote's error only when
    the store cannot be used either."""

    def __init__(self, remote: SpawnRegistry, store: HostSpawnStore, *, faults: FaultLog) -> None:
        self._remote = remote
        self._store = store
        self._faults = faults

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        try:
            found = self._remote.find(run_id, child_agent_id)
        except Exception as exc:
            held = self._held(run_id, child_agent_id, exc)
            self._remote_failed(exc)
            if held is None:
                return None
            return record_of(held[0], offline=not held[1])
        self._answered()
        if found is not None:
            return found
        # Not in PostgreSQL: a spawn of this host registered while it did not answer, whose
        # event is not delivered yet, is registered now (any process of the host may do it).
        held = self._held(run_id, child_agent_id, None)
        if held is None or held[1]:
            return None
        record = self._remote.register(held[0])
        self._keep(run_id, child_agent_id, record, held[0].key)
        return record

    def register(self, claim: SpawnClaim) -> SpawnRecord:
        # The host's file first: a process of the host that registered the child there while it
        # could not reach PostgreSQL (even a moment ago) has a spawn that counts, and may already
        # run the child under it.
        try:
            held, mine, registered = self._store.claim(claim)
        except (sqlite3.Error, OSError) as exc:
            self._store_failed(exc)
            return self._remote.register(claim)
        try:
            # A spawn the file knows from PostgreSQL is only a copy: PostgreSQL decides (its
            # lookup just missed it when the database was emptied or created again since).
            sent = claim if registered else held
            record = self._remote.register(sent)
        except Exception as exc:
            self._remote_failed(exc)
            return record_of(held, won=mine, offline=True)
        self._answered()
        self._keep(claim.run_id, claim.child_agent_id, record, sent.key)
        # Won when the registered spawn is this claim, whoever registered it: another process of
        # the host may have sent this claim (from the file) to PostgreSQL a moment ago; and not
        # when this registered another process's claim from the file.
        return replace(record, won=is_claimed(record.spawned_at, claim))

    def _held(
        self, run_id: str, child_agent_id: str, remote_error: Exception | None
    ) -> tuple[SpawnClaim, bool] | None:
        try:
            return self._store.find(run_id, child_agent_id)
        except (sqlite3.Error, OSError) as exc:
            self._store_failed(exc)
            if remote_error is not None:
                raise remote_error from None
            return None

    def _keep(self, run_id: str, child_agent_id: str, record: SpawnRecord, key: str | None) -> None:
        try:
            self._store.registered(claim_of(run_id, child_agent_id, record, key))
        except (sqlite3.Error, OSError) as exc:
            self._store_failed(exc)

    def _remote_failed(self, exc: Exception) -> None:
        self._faults.fault(
            SPAWNS_CONDITION,
            f"cannot reach the spawn registry in PostgreSQL ({_first_line(exc)})",
            consequence=(
                f"spawns are registered in {self._store.path} until it answers, and in "
                "PostgreSQL when their events are delivered"
            ),
        )

    def _answered(self) -> None:
        if self._faults.is_active(SPAWNS_CONDITION):
            self._faults.recovered(SPAWNS_CONDITION, detail="spawns are registered in PostgreSQL")

    def _store_failed(self, exc: BaseException) -> None:
        self._faults.fault(
            SPAWNS_CONDITION + " file",
            f"cannot use {self._store.path} ({exc})",
            consequence="spawns are registered in PostgreSQL alone",
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
