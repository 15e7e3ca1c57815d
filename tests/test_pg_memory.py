"""PostgresMemory: a run's memory shared by processes, each write and its event one transaction,
the chain of a key's writes replaying to its value, compare-and-set, and copies on every read."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from anthropic_support import stored  # noqa: F401 (fixture)

import otel_agentcap as ac
from otel_agentcap.capture.ledger import set_tool_ledger
from otel_agentcap.errors import MemoryUnavailable
from otel_agentcap.exporters.postgres import Database, PostgresMemory
from otel_agentcap.exporters.postgres import memory as memory_module
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
from otel_agentcap.model import EventRef
from otel_agentcap.testing import capture_events

pytestmark = pytest.mark.storage


@pytest.fixture()
def database(pg_dsn: str) -> Iterator[Database]:
    db = Database(pg_dsn)
    try:
        yield db
    finally:
        db.close()


def _run_id() -> str:
    return f"pgmem-{uuid.uuid4().hex[:10]}"


def _rows(dsn: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


def _chain(dsn: str, run_id: str, key: str) -> list[dict[str, Any]]:
    """The stored memory_write events of ``key``, each with its causal parents, in chain order:
    from the first write, each next one is the write whose parents name it."""
    rows = _rows(
        dsn,
        "SELECT event_id::text, causal_parent_ids::text[], logical_seq, payload "
        "FROM agentcap.events WHERE run_id = %s AND event_type = 'memory_write' "
        "AND payload->>'key' = %s",
        run_id,
        key,
    )
    writes = {
        event_id: {"id": event_id, "parents": parents, "seq": seq, "payload": payload}
        for event_id, parents, seq, payload in rows
    }
    ids = set(writes)
    firsts = [w for w in writes.values() if not ids.intersection(w["parents"])]
    assert len(firsts) == 1, "one write starts the chain"
    children: dict[str, list[dict[str, Any]]] = {}
    for write in writes.values():
        for parent in ids.intersection(write["parents"]):
            children.setdefault(parent, []).append(write)
    chain = [firsts[0]]
    while chain[-1]["id"] in children:
        (following,) = children[chain[-1]["id"]]  # a chain, never a fork
        chain.append(following)
    assert len(chain) == len(writes)
    return chain


def _replay(chain: list[dict[str, Any]]) -> Any:
    """Apply the chain's writes in order, checking each one's before against the state so far."""
    state: tuple[bool, Any] = (False, None)
    for write in chain:
        payload = write["payload"]
        assert (payload["before_found"], payload.get("before")) == state
        state = (payload["after_found"], payload.get("after"))
    return state


_WRITER = textwrap.dedent(
    """
    import sys, time
    import otel_agentcap as ac
    from otel_agentcap.configure import configure
    from otel_agentcap.exporters.postgres import PostgresMemory

    dsn, run_id, name, increments, threads, start_at = sys.argv[1:7]
    increments, threads, start_at = int(increments), int(threads), float(start_at)
    agentcap = configure(dsn, announce=False)
    memory = PostgresMemory("shared")

    failures = []

    def work(t):
        try:
            increment(t)
        except BaseException:
            import traceback
            failures.append(traceback.format_exc())

    def increment(t):
        with ac.run(run_id, resume=True), ac.agent(f"{name}-{t}"):
            for i in range(increments):
                while True:  # compare-and-set increment of one counter
                    seen = memory.lookup("counter")
                    if memory.compare_and_set("counter", seen.version, (seen.value or 0) + 1):
                        break
                memory["last"] = {"writer": f"{name}-{t}", "i": i}  # plain writes, same key

    while time.time() < start_at:
        time.sleep(0.001)
    pool = [ac.start_thread(work, t) for t in range(threads)]
    for t in pool:
        t.join()
    # Everything delivered before the test reads the log: a slow machine may need longer than
    # the default shutdown timeout, and what a shutdown leaves queued would read as lost.
    report = agentcap.shutdown(timeout=150)
    if report is not None and (report.spans_left or report.adopted_left or report.spans_lost):
        sys.exit(f"shutdown left spans undelivered: {report}")
    if failures:  # a thread's exception would otherwise only be printed, and the exit status 0
        sys.exit("\\n".join(failures))
    """
)


@pytest.mark.multiprocess
def test_writers_in_several_processes_replay_to_the_final_value(pg_dsn):
    """3 processes x 2 threads (agents of their own) incrementing one key with compare-and-set
    and overwriting another: no increment is lost, and for each key the chain of stored writes
    (each naming the previous one) replays, before by after, to the stored value; every read names
    the write whose value it found and comes after it; the exporter's copies of those events are
    duplicates, not conflicts."""
    run_id = _run_id()
    start_at = time.time() + 3.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, pg_dsn, run_id, f"p{p}", "15", "2", str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    counter_chain = _chain(pg_dsn, run_id, "counter")
    assert len(counter_chain) == 3 * 2 * 15
    assert _replay(counter_chain) == (True, 90)
    last_chain = _chain(pg_dsn, run_id, "last")
    assert len(last_chain) == 3 * 2 * 15
    ((stored_value, version),) = _rows(
        pg_dsn,
        "SELECT value, version FROM agentcap.memory WHERE run_id = %s AND key = 'last'",
        run_id,
    )
    assert _replay(last_chain) == (True, stored_value)
    assert version == 90
    for chain in (counter_chain, last_chain):
        assert all(a["seq"] < b["seq"] for a, b in itertools.pairwise(chain))
    # Every read, in any process, found what the write it names left, and came after it.
    written = {w["id"]: w for w in counter_chain}
    reads = _rows(
        pg_dsn,
        "SELECT causal_parent_ids::text[], logical_seq, payload FROM agentcap.events "
        "WHERE run_id = %s AND event_type = 'memory_read' AND payload->>'key' = 'counter'",
        run_id,
    )
    assert len(reads) >= 90
    for parents, seq, payload in reads:
        if not parents:  # a read before the first write
            assert payload["found"] is False
            continue
        (parent,) = parents
        assert written[parent]["seq"] < seq
        assert payload["value"] == written[parent]["payload"]["after"]
    assert _rows(pg_dsn, "SELECT count(*) FROM agentcap.conflicts WHERE run_id = %s", run_id) == [
        (0,)
    ]


def test_a_write_and_its_event_are_stored_together(database, pg_dsn, stored):  # noqa: F811
    """A write's event row is in the log as soon as the write returns (one transaction), and the
    span's copy of it, exported later, is stored as a duplicate."""
    memory = PostgresMemory("m", database=database)
    run_id = _run_id()
    with ac.run(run_id, resume=True), ac.agent("a"):
        ref = memory.set("k", {"v": 1})
        assert ref is not None
        rows = _rows(
            pg_dsn,
            "SELECT event_type, payload FROM agentcap.events WHERE event_id = %s",
            ref.event_id,
        )
        assert rows == [
            (
                "memory_write",
                {
                    "memory": "m",
                    "key": "k",
                    "op": "set",
                    "before_found": False,
                    "after_found": True,
                    "after": {"v": 1},
                },
            )
        ]
    assert stored.exporter.stats().duplicates >= 1
    assert stored.exporter.stats().conflicts == 0


def test_missing_none_delete_and_the_chain_through_a_delete(database):
    """A missing key and a stored None differ; a delete is a write, and the key's next write names
    it as causal parent; a read names the write it saw and comes after it."""
    memory = PostgresMemory("m", database=database)
    with capture_events() as captured, ac.run(_run_id()):
        with ac.agent("writer"):
            assert memory.lookup("k") == ac.Lookup(False)
            first = memory.set("k", None)
            assert first is not None
            assert memory.delete("k") is True
            assert memory.delete("k") is False
            again = memory.set("k", 2)
        with ac.agent("reader"):
            seen = memory.lookup("k")
    assert seen.found and seen.value == 2 and seen.written_by is not None
    assert seen.written_by[:3] == again[:3]
    # The write's span is stored with it: a read (in any process) links to it.
    assert seen.written_by.span is not None and again.span is not None
    assert seen.written_by.span.span_id == again.span.span_id
    assert "k" not in PostgresMemory("m", database=database, run_id="another-run")
    writes = captured.of_type("memory_write")
    assert [w.payload["op"] for w in writes] == ["set", "delete", "set"]
    assert writes[0].payload["after"] is None and writes[0].payload["after_found"] is True
    assert writes[1].causal_parent_ids == (writes[0].event_id,)
    assert writes[2].causal_parent_ids == (writes[1].event_id,)
    (read,) = [e for e in captured.of_type("memory_read") if e.agent_id == "reader"]
    assert read.causal_parent_ids == (writes[2].event_id,)
    assert read.seq > writes[2].seq


def test_a_read_after_a_delete_in_another_agent_follows_the_delete(database):
    """A read that finds a key missing because another agent deleted it names the delete (its
    tombstone's writer) as causal parent, and its sequence is above the delete's."""
    memory = PostgresMemory("m", database=database)
    with capture_events() as captured, ac.run(_run_id()):
        with ac.agent("writer") as writer:
            for _ in range(20):
                writer.context.clock.tick()
            memory["k"] = 1
            assert memory.delete("k") is True
        with ac.agent("reader"):
            seen = memory.lookup("k")
    delete = captured.of_type("memory_write")[-1]
    assert delete.payload["op"] == "delete"
    (read,) = captured.of_type("memory_read")
    assert seen.found is False and seen.written_by is not None
    assert seen.written_by.event_id == delete.event_id
    assert read.causal_parent_ids == (delete.event_id,)
    assert read.seq > delete.seq
    assert read.payload["written_by"] == delete.event_id


def test_a_write_still_being_encoded_when_its_agent_times_out_is_refused(database, pg_dsn):
    """A write whose value takes longer to encode than its agent has left (a codec of the user's)
    stores nothing and records no memory_write after the agent_error: the timed-out thread gets
    AgentCancelled."""
    release = threading.Event()
    outcome: list[BaseException | None] = []

    class SlowCodec:
        name = "slow"

        def encode(self, value: Any) -> Any:
            release.wait(10)
            return value

        def decode(self, data: Any) -> Any:
            return data

    run_id = _run_id()
    memory = PostgresMemory("m", database=database, codec=SlowCodec())

    def body() -> None:
        try:
            memory.set("k", 1)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    with capture_events() as captured, ac.run(run_id):
        agent = ac.agent("slow-writer").agent
        with pytest.raises(ac.AgentTimeoutError):
            agent.run(body, timeout=0.05)
        release.set()
        for thread in threading.enumerate():  # the worker, if it got to run at all
            if thread.name == "agent-slow-writer":
                thread.join(10)
    # The body got AgentCancelled (or, on a machine too slow to start it in time, never ran).
    assert all(isinstance(error, ac.AgentCancelled) for error in outcome)
    assert _rows(pg_dsn, "SELECT key FROM agentcap.memory WHERE run_id = %s", run_id) == []
    assert captured.of_type("memory_write") == []


def test_compare_and_set_writes_only_at_the_expected_version(database):
    """compare_and_set writes (and records) only when the key is at the expected version."""
    memory = PostgresMemory("m", database=database)
    with capture_events() as captured, ac.run(_run_id()), ac.agent("a"):
        assert memory.compare_and_set("k", 1, "no") is False
        assert memory.compare_and_set("k", 0, "first")
        assert memory.lookup("k").version == 1
        assert memory.compare_and_set("k", 0, "stale") is False
        assert memory.compare_and_set("k", 1, "second")
        assert memory["k"] == "second"
    assert [w.payload["after"] for w in captured.of_type("memory_write")] == ["first", "second"]


def test_a_read_value_is_the_readers_own(database):
    """Mutating a value read from the memory changes neither the memory nor later reads."""
    memory = PostgresMemory("m", database=database)
    with ac.run(_run_id()), ac.agent("a"):
        memory["k"] = {"items": [1]}
        value = memory["k"]
        value["items"].append(2)
        assert memory["k"] == {"items": [1]}


def test_a_writer_behind_the_last_writers_clock_moves_past_it(database):
    """A write by an agent whose clock is behind the key's last write (by another agent) gets a
    sequence above that write, its causal parent."""
    memory = PostgresMemory("m", database=database)
    with capture_events() as captured, ac.run(_run_id()):
        with ac.agent("fast") as fast:
            for _ in range(50):
                fast.context.clock.tick()
            memory["k"] = "fast"
        with ac.agent("slow"):
            memory["k"] = "slow"
    fast_write, slow_write = captured.of_type("memory_write")
    assert slow_write.causal_parent_ids == (fast_write.event_id,)
    assert slow_write.seq > fast_write.seq


@pytest.mark.fault
def test_an_unreachable_database_is_an_error_of_the_memory():
    """Reads and writes of a memory whose database is unreachable raise MemoryUnavailable."""
    database = Database("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1")
    memory = PostgresMemory("m", database=database, timeout=0.5)
    try:
        with ac.run(_run_id()), ac.agent("a"):
            with pytest.raises(MemoryUnavailable):
                memory["k"] = 1
            with pytest.raises(MemoryUnavailable):
                memory.lookup("k")
    finally:
        database.close()


@pytest.mark.fault
def test_a_write_that_waited_for_a_lock_leaves_the_tool_ledger_available(pg_dsn):
    """A write that waits for a lock another session holds on ``agentcap.memory`` fails with
    MemoryUnavailable without taking the database it shares with the tool ledger out of use: the
    next protected tool call is claimed in the ledger, not run unprotected."""
    database = Database(pg_dsn)
    ledger = PostgresToolLedger(database)
    memory = PostgresMemory("m", database=database)
    run_id = _run_id()
    calls: list[int] = []

    @ac.tool
    def work(n: int) -> int:
        calls.append(n)
        return n

    set_tool_ledger(ledger)
    try:
        with ac.run(run_id), ac.agent("a"):
            with psycopg.connect(pg_dsn) as holder:
                holder.execute("LOCK TABLE agentcap.memory IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(MemoryUnavailable):
                    memory["k"] = 1
                holder.rollback()
            assert work.invoke("w", 1) == 1
            memory["k"] = 2
            assert memory["k"] == 2
        assert calls == [1]
        assert ledger.stats().unavailable == 0
        assert _rows(
            pg_dsn, "SELECT status FROM agentcap.tool_ledger WHERE run_id = %s", run_id
        ) == [("succeeded",)]
    finally:
        set_tool_ledger(None)
        ledger.close()
        database.close()


@pytest.mark.fault
def test_a_write_after_the_server_closed_the_idle_connections_succeeds(pg_dsn):
    """With idle_session_timeout on the database (or a proxy that closes idle connections), the
    server closes the pooled connections between two writes; the next write and read take new
    connections and succeed, rather than raise MemoryUnavailable while the server is up."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET idle_session_timeout = '200ms'")
    database = Database(pg_dsn)
    memory = PostgresMemory("m", database=database)
    try:
        with capture_events(), ac.run(_run_id()), ac.agent("a"):
            memory.set("k", 1)
            with psycopg.connect(pg_dsn, autocommit=True) as admin:
                admin.execute("SET idle_session_timeout = 0")
                ours = (
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name LIKE 'otel-agentcap-%%'"
                )
                deadline = time.monotonic() + 60
                while admin.execute(ours).fetchone() != (0,):  # the server closes them
                    assert time.monotonic() < deadline, "the server kept the idle connections"
                    time.sleep(0.05)
            memory.set("k", 2)
            assert memory["k"] == 2
    finally:
        database.close()


@pytest.mark.fault
@pytest.mark.parametrize("broken", ["after_the_commit", "before_the_server_read_it"])
def test_a_write_whose_answer_was_lost_is_found_written_or_made_again(
    database, pg_dsn, monkeypatch, broken
):
    """If the connection breaks after a write was sent (the client sees an error; the write may
    have committed), the memory looks for the write's event on a new connection: a committed write
    returns as written (compare_and_set returns its event, neither an error nor False on a retry),
    one that was not committed is made again; the key holds one write of the value either way."""
    real = memory_module.rows_waiting_for_locks_at_most
    armed: list[bool] = []
    lost: list[bool] = []

    def lost_answer(conn: Any, db: Database, query: bytes, params: Any) -> Any:
        if query != memory_module._WRITE or not armed or lost:
            return real(conn, db, query, params)
        lost.append(True)
        if broken == "before_the_server_read_it":
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        rows = real(conn, db, query, params)
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        conn.execute(b"SELECT 1")  # the connection is lost: OperationalError, marked broken
        return rows

    monkeypatch.setattr(memory_module, "rows_waiting_for_locks_at_most", lost_answer)
    memory = PostgresMemory("m", database=database)
    run_id = _run_id()
    with capture_events() as captured, ac.run(run_id), ac.agent("a"):
        memory.set("k", "first")
        armed.append(True)
        ref = memory.compare_and_set("k", 1, "second")
        assert lost == [True]
        assert isinstance(ref, EventRef)
        assert memory.lookup("k").version == 2
        assert memory["k"] == "second"
    chain = _chain(pg_dsn, run_id, "k")
    assert [write["payload"]["after"] for write in chain] == ["first", "second"]
    assert chain[-1]["id"] == ref.event_id
    assert [w.payload["after"] for w in captured.of_type("memory_write")] == ["first", "second"]


def test_concurrent_readers_and_writers_each_read_names_the_write_it_saw(database):
    """Agents in threads writing, deleting and reading two keys at once: every read finds what
    the write it names as causal parent left (its value, or nothing after a delete), and comes
    after it."""
    memory = PostgresMemory("busy", database=database)
    barrier = threading.Barrier(6)

    def worker(i: int) -> None:
        with ac.agent(f"agent-{i % 3}"):
            barrier.wait()
            for j in range(15):
                key = "ab"[j % 2]
                if j % 5 == 4:
                    memory.delete(key)
                elif j % 3 == 0:
                    memory[key] = None if j % 2 else [i, j]
                else:
                    memory.lookup(key)

    with capture_events() as captured, ac.run(_run_id()):
        threads = [ac.start_thread(worker, i) for i in range(6)]
        for thread in threads:
            thread.join()
    writes = {e.event_id: e for e in captured.of_type("memory_write")}
    reads = captured.of_type("memory_read")
    assert reads and writes
    for read in reads:
        if not read.causal_parent_ids:
            assert read.payload["found"] is False
            continue
        (parent_id,) = read.causal_parent_ids
        parent = writes[parent_id]
        assert parent.payload["key"] == read.payload["key"]
        assert parent.seq < read.seq
        assert read.payload["found"] is parent.payload["after_found"]
        if read.payload["found"]:
            assert read.payload["value"] == parent.payload["after"]
