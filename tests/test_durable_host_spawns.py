"""This host's spawn file: spawns registered while PostgreSQL does not answer, agreed on by the
processes of the host, and registered in PostgreSQL by the first lookup once it answers."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest

from otel_agentcap.exporters.durable.host_spawns import HostAwareSpawnRegistry, HostSpawnStore
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.exporters.postgres import Database
from otel_agentcap.exporters.postgres.recovery import PostgresSpawnRegistry
from otel_agentcap.protocols import SpawnClaim, SpawnRecord

pytestmark = pytest.mark.storage


class _Down:
    """A spawn registry whose database does not answer."""

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        raise ConnectionError("PostgreSQL is down")

    def register(self, claim: SpawnClaim) -> SpawnRecord:
        raise ConnectionError("PostgreSQL is down")


def _claim(run_id: str, seq: int, event: str = "") -> SpawnClaim:
    return SpawnClaim(
        run_id,
        "parent/w",
        "parent",
        "worker",
        "w",
        str(uuid.uuid5(uuid.NAMESPACE_URL, run_id + event)),
        seq,
        "0" * 31 + "1",
        f"{seq:016x}",
    )


def test_the_first_offline_spawn_of_a_child_wins_on_the_host(tmp_path):
    """While PostgreSQL is down the first registration of a child in the host's file wins; a
    later one (another process's retry) gets the first one's event, sequence and span."""
    path = tmp_path / "spawns.sqlite3"
    first = HostAwareSpawnRegistry(_Down(), HostSpawnStore(path), faults=FaultLog())
    second = HostAwareSpawnRegistry(_Down(), HostSpawnStore(path), faults=FaultLog())
    won = first.register(_claim("r", 7))
    lost = second.register(_claim("r", 9))
    assert (won.won, won.offline, lost.won, lost.offline) == (True, True, False, True)
    assert lost.spawned_at.seq == 7
    assert lost.spawn_span is not None and lost.spawn_span.span_id == 7
    found = second.find("r", "parent/w")
    assert found is not None and found.spawned_at.seq == 7


def test_an_offline_spawn_is_registered_by_the_first_lookup_once_postgres_answers(pg_dsn, tmp_path):
    """A spawn registered in the host's file only is registered in PostgreSQL by the first
    lookup of its child once the database answers, so a retry then gets that spawn."""
    run_id = f"host-spawns-{uuid.uuid4().hex[:10]}"
    store = HostSpawnStore(tmp_path / "spawns.sqlite3")
    HostAwareSpawnRegistry(_Down(), store, faults=FaultLog()).register(_claim(run_id, 7))
    database = Database(pg_dsn)
    try:
        remote = PostgresSpawnRegistry(database)
        registry = HostAwareSpawnRegistry(remote, store, faults=FaultLog())
        found = registry.find(run_id, "parent/w")
        assert found is not None and found.spawned_at.seq == 7
        stored = remote.find(run_id, "parent/w")
        assert stored is not None and stored.spawned_at == found.spawned_at
        held = store.find(run_id, "parent/w")
        assert held is not None and held[1]  # registered
    finally:
        database.close()
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT spawn_seq, span_id FROM agentcap.spawns WHERE run_id = %s", (run_id,)
        ).fetchall()
    assert rows == [(7, f"{7:016x}")]


def test_a_process_that_reaches_postgres_takes_the_spawn_another_registered_offline(
    pg_dsn, tmp_path
):
    """A process of the host that reaches PostgreSQL and registers a child that another process
    of the host registered in the file a moment before (while it could not reach PostgreSQL)
    gets that spawn, not its own, and registers it there: the other's child is the child."""
    run_id = f"host-spawns-{uuid.uuid4().hex[:10]}"
    store = HostSpawnStore(tmp_path / "spawns.sqlite3")
    offline = HostAwareSpawnRegistry(_Down(), store, faults=FaultLog())
    assert offline.register(_claim(run_id, 7)).won
    database = Database(pg_dsn)
    try:
        online = HostAwareSpawnRegistry(PostgresSpawnRegistry(database), store, faults=FaultLog())
        record = online.register(_claim(run_id, 9))
    finally:
        database.close()
    assert (record.won, record.offline, record.spawned_at.seq) == (False, False, 7)
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT spawn_seq FROM agentcap.spawns WHERE run_id = %s", (run_id,)
        ).fetchall()
    assert rows == [(7,)]


class _RegistersAfter:
    """A spawn registry that lets another process of the host register first."""

    def __init__(self, remote: PostgresSpawnRegistry, first: Callable[[], object]) -> None:
        self._remote = remote
        self._first = first

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        return self._remote.find(run_id, child_agent_id)

    def register(self, claim: SpawnClaim) -> SpawnRecord:
        self._first()
        return self._remote.register(claim)


def test_a_spawn_another_process_registered_for_its_owner_is_still_the_owners(pg_dsn, tmp_path):
    """Process A holds the child in the host's file; process B, spawning it too, finds A's spawn
    there and registers it in PostgreSQL before A does. A's registration then finds its own spawn
    registered: it won (its span carries the event), and B did not. Before the fix A was told it
    lost, so neither recorded the agent_spawn event the log's spawn row names."""
    run_id = f"host-spawns-{uuid.uuid4().hex[:10]}"
    path = tmp_path / "spawns.sqlite3"
    database = Database(pg_dsn)
    try:
        remote = PostgresSpawnRegistry(database)
        second = HostAwareSpawnRegistry(remote, HostSpawnStore(path), faults=FaultLog())
        records: list[SpawnRecord] = []
        first = HostAwareSpawnRegistry(
            _RegistersAfter(
                remote, lambda: records.append(second.register(_claim(run_id, 9, "b")))
            ),
            HostSpawnStore(path),
            faults=FaultLog(),
        )
        mine = first.register(_claim(run_id, 7, "a"))
    finally:
        database.close()
    (theirs,) = records
    assert (mine.won, mine.offline, mine.spawned_at.seq) == (True, False, 7)
    assert (theirs.won, theirs.offline, theirs.spawned_at.seq) == (False, False, 7)
    assert mine.spawned_at.event_id == theirs.spawned_at.event_id == _claim(run_id, 7, "a")[5]
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT spawn_seq FROM agentcap.spawns WHERE run_id = %s", (run_id,)
        ).fetchall()
    assert rows == [(7,)]


def test_registering_ones_own_spawn_again_wins_again(pg_dsn):
    """``won`` says whether the registered spawn is the caller's: a second registration of the
    same claim (a retry after an answer that was lost) wins; another claim of the child does not."""
    run_id = f"host-spawns-{uuid.uuid4().hex[:10]}"
    database = Database(pg_dsn)
    try:
        remote = PostgresSpawnRegistry(database)
        first = remote.register(_claim(run_id, 7, "a"))
        again = remote.register(_claim(run_id, 7, "a"))
        other = remote.register(_claim(run_id, 9, "b"))
    finally:
        database.close()
    assert (first.won, again.won, other.won) == (True, True, False)
    assert first.spawned_at == again.spawned_at == other.spawned_at


def test_a_spawn_the_file_copied_from_postgres_does_not_outlive_the_database(pg_dsn, tmp_path):
    """A spawn the file holds as registered in PostgreSQL, which PostgreSQL no longer holds (the
    database emptied or created again), is not handed out: the new spawn is registered."""
    run_id = f"host-spawns-{uuid.uuid4().hex[:10]}"
    store = HostSpawnStore(tmp_path / "spawns.sqlite3")
    store.registered(_claim(run_id, 7))
    database = Database(pg_dsn)
    try:
        registry = HostAwareSpawnRegistry(PostgresSpawnRegistry(database), store, faults=FaultLog())
        assert registry.find(run_id, "parent/w") is None
        record = registry.register(_claim(run_id, 9))
    finally:
        database.close()
    assert (record.won, record.spawned_at.seq) == (True, 9)
    held = store.find(run_id, "parent/w")
    assert held is not None and (held[0].spawn_seq, held[1]) == (9, True)
