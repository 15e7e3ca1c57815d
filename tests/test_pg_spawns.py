"""Spawns registered in PostgreSQL when they happen: concurrent and staggered spawns of the same
children from several processes (before anything is exported) give one spawn event per child, and
the stored log has no Lamport violation and no child event at or below its spawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import psycopg
import pytest

import otel_agentcap as ac
from otel_agentcap.capture.agents import set_spawn_registry
from otel_agentcap.capture.ledger import set_tool_ledger
from otel_agentcap.exporters.postgres import Database
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
from otel_agentcap.exporters.postgres.recovery import PostgresSpawnRegistry
from otel_agentcap.testing import capture_events

pytestmark = pytest.mark.storage

# THREADS threads of agent "parent" each spawn the children c0..c{CHILDREN-1} and run each one,
# which writes memory and calls a tool. Spans are exported in batches, so every spawn is registered
# before its span reaches the log. With OTEL_BSP_SCHEDULE_DELAY set, the worker holds its spans in
# the in-memory export queue (durable=False) for that long: the durable queue delivers at once.
_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, run_id, children, threads, start_at, linger = sys.argv[1:7]
    children, threads = int(children), int(threads)
    start_at = float(start_at)
    agentcap = configure(
        dsn, announce=False, durable="OTEL_BSP_SCHEDULE_DELAY" not in os.environ
    )
    memory = ac.Memory("local")

    @ac.tool
    def note(n):
        return n

    def work(t):
        with ac.run(run_id, resume=True), ac.agent("parent") as parent:
            for k in range(children):
                child = parent.spawn("worker", key=f"c{k}")
                child.run(lambda: (memory.set(f"k{t}", k), note.invoke(f"n{k}", k)))
            # Linger (inside the run) until the file named by linger exists, if one is named.
            deadline = time.time() + 120
            while linger and not os.path.exists(linger) and time.time() < deadline:
                time.sleep(0.05)

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
    """
)


def _start(
    dsn: str,
    run_id: str,
    *,
    children: int,
    threads: int,
    start_at: float,
    linger: str = "",
    export_delay_ms: int | None = None,
) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if export_delay_ms is not None:
        env["OTEL_BSP_SCHEDULE_DELAY"] = str(export_delay_ms)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _WORKER,
            dsn,
            run_id,
            str(children),
            str(threads),
            str(start_at),
            linger,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err


def _rows(dsn: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


def _check_log(dsn: str, run_id: str, children: int) -> None:
    spawns = _rows(
        dsn,
        "SELECT payload->>'child_agent_id', count(*) FROM agentcap.events "
        "WHERE run_id = %s AND event_type = 'agent_spawn' GROUP BY 1 ORDER BY 1",
        run_id,
    )
    assert spawns == [(f"parent/c{k}", 1) for k in range(children)]
    lamport_violations = _rows(
        dsn,
        "SELECT count(*) FROM agentcap.events e JOIN agentcap.events p "
        "ON p.event_id = ANY (e.causal_parent_ids) "
        "WHERE e.run_id = %s AND e.logical_seq <= p.logical_seq",
        run_id,
    )
    assert lamport_violations == [(0,)]
    before_spawn = _rows(
        dsn,
        "SELECT count(*) FROM agentcap.agents a "
        "JOIN agentcap.events s ON s.event_id = a.spawned_at_event_id "
        "JOIN agentcap.events c ON c.run_id = a.run_id AND c.agent_id = a.agent_id "
        "WHERE a.run_id = %s AND c.logical_seq <= s.logical_seq",
        run_id,
    )
    assert before_spawn == [(0,)]
    # Every child and its spawn row name the one stored spawn event; so does every agent_start.
    unlinked = _rows(
        dsn,
        "SELECT count(*) FROM agentcap.agents a JOIN agentcap.spawns r "
        "ON r.run_id = a.run_id AND r.child_agent_id = a.agent_id "
        "LEFT JOIN agentcap.events s ON s.event_id = a.spawned_at_event_id "
        "WHERE a.run_id = %s AND (s.event_id IS NULL OR r.spawn_event_id <> s.event_id "
        "OR r.spawn_seq <> s.logical_seq OR r.span_id <> s.span_id OR r.trace_id <> s.trace_id)",
        run_id,
    )
    assert unlinked == [(0,)]
    starts = _rows(
        dsn,
        "SELECT count(*) FROM agentcap.events c JOIN agentcap.spawns r "
        "ON r.run_id = c.run_id AND r.child_agent_id = c.agent_id "
        "WHERE c.run_id = %s AND c.event_type = 'agent_start' "
        "AND NOT r.spawn_event_id = ANY (c.causal_parent_ids)",
        run_id,
    )
    assert starts == [(0,)]
    assert _rows(dsn, "SELECT count(*) FROM agentcap.conflicts WHERE run_id = %s", run_id) == [(0,)]


@pytest.mark.multiprocess
def test_concurrent_spawns_of_the_same_children_from_several_processes(pg_dsn):
    """4 processes x 3 threads spawning and running the same 8 children at once: one spawn event
    per child, no Lamport violation, no child event at or below its spawn."""
    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    start_at = time.time() + 3.0
    procs = [_start(pg_dsn, run_id, children=8, threads=3, start_at=start_at) for _ in range(4)]
    _wait(procs)
    _check_log(pg_dsn, run_id, 8)
    executions = _rows(
        pg_dsn,
        "SELECT count(*) FROM agentcap.events WHERE run_id = %s AND event_type = 'agent_start' "
        "AND agent_id LIKE 'parent/%%'",
        run_id,
    )
    assert executions == [(4 * 3 * 8,)]


@pytest.mark.multiprocess
def test_staggered_spawns_before_the_first_export(pg_dsn, tmp_path):
    """A second process spawns the same children while the first still runs them and has exported
    nothing yet: it gets the first process's children and spawn events, and records none."""
    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    release = tmp_path / "release"
    # The first process exports only when it shuts down, which it does once released, after the
    # second has finished.
    first = _start(
        pg_dsn,
        run_id,
        children=5,
        threads=1,
        start_at=0.0,
        linger=str(release),
        export_delay_ms=600_000,
    )
    deadline = time.monotonic() + 120
    while _rows(pg_dsn, "SELECT count(*) FROM agentcap.spawns WHERE run_id = %s", run_id) != [(5,)]:
        assert first.poll() is None, first.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    second = _start(pg_dsn, run_id, children=5, threads=2, start_at=0.0)
    _wait([second])
    assert first.poll() is None  # still running its children's scope
    # The first process has not exported yet: the log has none of its spawn events (the second
    # recorded none), but the registry has every child.
    assert _rows(
        pg_dsn,
        "SELECT count(*) FROM agentcap.events WHERE run_id = %s AND event_type = 'agent_spawn'",
        run_id,
    ) == [(0,)]
    assert _rows(pg_dsn, "SELECT count(*) FROM agentcap.spawns WHERE run_id = %s", run_id) == [(5,)]
    release.touch()
    _wait([first])
    _check_log(pg_dsn, run_id, 5)


def test_a_child_resumed_after_a_restart_links_to_its_registered_spawn(pg_dsn):
    """A spawn retried after the process forgot the run (as a new process would) gets the same
    child and spawn event, records no second spawn, and the child's span links to the stored
    spawn span."""
    database = Database(pg_dsn)
    set_spawn_registry(PostgresSpawnRegistry(database))
    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    try:
        with capture_events() as captured:
            with ac.run(run_id, resume=True), ac.agent("parent") as parent:
                first = parent.spawn("worker", key="w")
                first.run(lambda: None)
            with (
                ac.run(run_id, resume=True),
                ac.agent("parent") as parent,
            ):  # released and entered again
                again = parent.spawn("worker", key="w")
                again.run(lambda: None)
    finally:
        set_spawn_registry(None)
        database.close()
    assert again is not first
    assert again.spawned_at is not None and first.spawned_at is not None
    assert again.spawned_at[:3] == first.spawned_at[:3]
    assert again.spawn_span_context is not None
    assert first.spawn_span_context is not None
    assert again.spawn_span_context.span_id == first.spawn_span_context.span_id
    assert len(captured.of_type("agent_spawn")) == 1
    spawn_span = next(s for s in captured.spans if s.name == "create_agent parent/w")
    invoke_spans = [s for s in captured.spans if s.name.startswith("invoke_agent parent/w")]
    assert len(invoke_spans) == 2
    for span in invoke_spans:  # both executions run under the one stored spawn span
        assert span.parent is not None and span.parent.span_id == spawn_span.context.span_id
        assert spawn_span.context.span_id in [link.context.span_id for link in span.links]
    starts = [e for e in captured.of_type("agent_start") if e.agent_id == "parent/w"]
    assert all(e.causal_parent_ids == (first.spawned_at.event_id,) for e in starts)  # type: ignore[union-attr]
    assert all(e.seq > first.spawned_at.seq for e in starts)  # type: ignore[union-attr]


def test_a_spawned_child_entered_by_id_in_a_continued_run_keeps_its_spawn(pg_dsn):
    """``agent(child_id)`` in a continued run (as a process taking over a child would) enters the
    stored child: its execution runs under the create_agent span that spawned it, its agent_start
    comes after and names the spawn event, and the child keeps its parent."""
    database = Database(pg_dsn)
    set_spawn_registry(PostgresSpawnRegistry(database))
    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    try:
        with capture_events() as captured:
            with ac.run(run_id, resume=True), ac.agent("parent") as parent:
                first = parent.spawn("worker", key="w")
            # The run released here, as in a new process: the child is known from the log only.
            with ac.run(run_id, resume=True), ac.agent("parent/w") as entered:
                entered.state["k"] = 1
    finally:
        set_spawn_registry(None)
        database.close()
    assert first.spawned_at is not None and first.spawn_span_context is not None
    spawn_span = next(s for s in captured.spans if s.name == "create_agent parent/w")
    (invoke,) = [s for s in captured.spans if s.name.startswith("invoke_agent parent/w")]
    assert invoke.parent is not None and invoke.parent.span_id == spawn_span.context.span_id
    (start,) = [e for e in captured.of_type("agent_start") if e.agent_id == "parent/w"]
    assert start.causal_parent_ids == (first.spawned_at.event_id,)
    assert start.seq > first.spawned_at.seq
    record = captured.agents[(run_id, "parent/w")]
    assert (record.parent_agent_id, record.name) == ("parent", "worker")


def test_an_agent_of_a_new_run_asks_no_spawn_registry(pg_dsn):
    """Only a continued run can hold a stored spawn: agents of a new run are not looked up."""
    asked: list[tuple[str, str]] = []

    class _Counting(PostgresSpawnRegistry):
        def find(self, run_id: str, child_agent_id: str) -> Any:
            asked.append((run_id, child_agent_id))
            return super().find(run_id, child_agent_id)

    database = Database(pg_dsn)
    set_spawn_registry(_Counting(database))
    try:
        with ac.run(f"spawns-{uuid.uuid4().hex[:10]}"), ac.agent("planner"):
            pass
    finally:
        set_spawn_registry(None)
        database.close()
    assert asked == []


@pytest.mark.fault
def test_a_lock_held_on_the_spawn_registry_leaves_the_tool_ledger_available(pg_dsn):
    """A spawn whose registry statements wait for a lock another session holds on
    ``agentcap.spawns`` gives up without taking the database it shares with the tool ledger out
    of use: the next protected tool call is claimed in the ledger, not run unprotected."""
    database = Database(pg_dsn)
    ledger = PostgresToolLedger(database)
    set_tool_ledger(ledger)
    set_spawn_registry(PostgresSpawnRegistry(database))
    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    runs: list[int] = []

    @ac.tool
    def effect(n: int) -> int:
        runs.append(n)
        return n

    try:
        with (
            capture_events() as captured,
            ac.run(run_id, resume=True),
            ac.agent("parent") as parent,
        ):
            with psycopg.connect(pg_dsn) as holder:
                holder.execute("LOCK TABLE agentcap.spawns IN ACCESS EXCLUSIVE MODE")
                child = parent.spawn("worker", key="w")
                holder.rollback()
            assert effect.invoke("after-the-spawn", 1) == 1
            child.run(lambda: None)
    finally:
        set_tool_ledger(None)
        set_spawn_registry(None)
        ledger.close()
        database.close()
    assert ledger.stats().unavailable == 0
    assert _rows(
        pg_dsn, "SELECT invocation_id, status FROM agentcap.tool_ledger WHERE run_id = %s", run_id
    ) == [("after-the-spawn", "succeeded")]
    assert runs == [1]
    assert len(captured.of_type("agent_spawn")) == 1


def test_a_spawn_registered_by_another_parent_is_a_conflict(pg_dsn):
    """A child registered under one parent cannot be spawned by another, in any process."""
    database = Database(pg_dsn)
    set_spawn_registry(PostgresSpawnRegistry(database))
    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    try:
        with ac.run(run_id, resume=True), ac.agent("a"):
            ac.spawn("w", agent_id="shared-child")
        with ac.run(run_id, resume=True), ac.agent("b"), pytest.raises(ac.SpawnConflictError):
            ac.spawn("w", agent_id="shared-child")
    finally:
        set_spawn_registry(None)
        database.close()


_SPAWNER = textwrap.dedent(
    """
    import sys
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, run_id, queue_dir = sys.argv[1:4]
    with configure(dsn, announce=False, queue_dir=queue_dir):
        with ac.run(run_id, resume=True), ac.agent("parent") as parent:
            parent.spawn("worker", key="w").run(lambda: None)
    """
)


@pytest.mark.multiprocess
def test_a_spawn_that_is_not_recorded_is_not_registered(pg_dsn, tmp_path):
    """A spawn that records nothing (OTEL_SDK_DISABLED=true) is not registered: its event never
    reaches the log, so the retry of a process that records must record the spawn itself, not
    link its child to an event that is not there."""
    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    for disabled in (True, False):
        done = subprocess.run(
            [sys.executable, "-c", _SPAWNER, pg_dsn, run_id, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env | ({"OTEL_SDK_DISABLED": "true"} if disabled else {}),
        )
        assert done.returncode == 0, done.stderr
    with psycopg.connect(pg_dsn) as conn:
        spawns = conn.execute(
            "SELECT event_id FROM agentcap.events WHERE run_id = %s AND event_type = 'agent_spawn'",
            (run_id,),
        ).fetchall()
        dangling = conn.execute(
            "SELECT e.event_id, p FROM agentcap.events e, unnest(e.causal_parent_ids) p"
            " WHERE e.run_id = %(run)s AND NOT EXISTS (SELECT 1 FROM agentcap.events x"
            " WHERE x.run_id = %(run)s AND x.event_id = p)",
            {"run": run_id},
        ).fetchall()
        spawned_at = conn.execute(
            "SELECT spawned_at_event_id FROM agentcap.agents WHERE run_id = %s AND agent_id = %s",
            (run_id, "parent/w"),
        ).fetchone()
    assert len(spawns) == 1
    assert dangling == []
    assert spawned_at == spawns[0]


# One step of the outage tests: "spawn" spawns parent/w in agent "parent"; "retry" spawns it
# again and runs it (a tool call); "deliver" only starts and shuts down, delivering what the
# earlier processes left in the queue directory. Prints the process's export stats as JSON.
_OUTAGE_STEP = textwrap.dedent(
    """
    import dataclasses, json, sys
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, run_id, queue_dir, step = sys.argv[1:5]
    agentcap = configure(dsn, announce=False, queue_dir=queue_dir, shutdown_timeout=1)

    @ac.tool
    def note(n):
        return n

    if step != "deliver":
        with ac.run(run_id, resume=True), ac.agent("parent") as parent:
            child = parent.spawn("worker", key="w")
            if step == "retry":
                child.run(lambda: note.invoke("n", 1))
    agentcap.shutdown(60 if step == "deliver" else 1)
    print(json.dumps(dataclasses.asdict(agentcap.stats())))
    """
)


def _outage_step(dsn: str, run_id: str, queue_dir: object, step: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _OUTAGE_STEP, dsn, run_id, str(queue_dir), step],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _outage_log(dsn: str, run_id: str) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        spawns = conn.execute(
            "SELECT event_id, logical_seq FROM agentcap.events "
            "WHERE run_id = %s AND event_type = 'agent_spawn'",
            (run_id,),
        ).fetchall()
        starts = conn.execute(
            "SELECT causal_parent_ids, logical_seq FROM agentcap.events "
            "WHERE run_id = %s AND agent_id = 'parent/w' AND event_type = 'agent_start'",
            (run_id,),
        ).fetchall()
        registered = conn.execute(
            "SELECT spawn_event_id, spawn_seq FROM agentcap.spawns WHERE run_id = %s", (run_id,)
        ).fetchall()
        conflicts = conn.execute(
            "SELECT count(*) FROM agentcap.conflicts WHERE run_id = %s", (run_id,)
        ).fetchone()
        dangling = conn.execute(
            "SELECT count(*) FROM agentcap.events e, unnest(e.causal_parent_ids) p"
            " WHERE e.run_id = %(run)s AND NOT EXISTS (SELECT 1 FROM agentcap.events x"
            " WHERE x.run_id = %(run)s AND x.event_id = p)",
            {"run": run_id},
        ).fetchone()
        tools = conn.execute(
            "SELECT count(*) FROM agentcap.events WHERE run_id = %s AND agent_id = 'parent/w' "
            "AND event_type IN ('tool_invocation', 'tool_result')",
            (run_id,),
        ).fetchone()
    return {
        "spawns": spawns,
        "starts": starts,
        "registered": registered,
        "conflicts": conflicts[0] if conflicts else None,
        "dangling": dangling[0] if dangling else None,
        "tools": tools[0] if tools else None,
    }


@pytest.mark.fault
@pytest.mark.multiprocess
def test_a_spawn_retried_in_another_process_while_postgres_is_down(tmp_path):
    """A child spawned while PostgreSQL is down and spawned again (and run) by another process
    of the host, still down: the retry finds the first spawn in the host's file, so once the
    queue is delivered the log holds one agent_spawn event, registered, no conflict, and the
    child's agent_start names it as causal parent with a higher sequence."""
    from durable_support import restartable_server

    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    queue_dir = tmp_path / "queue"
    with restartable_server() as server:
        dsn = server.new_database()
        server.stop()
        try:
            _outage_step(dsn, run_id, queue_dir, "spawn")
            _outage_step(dsn, run_id, queue_dir, "retry")
        finally:
            server.start()
        _outage_step(dsn, run_id, queue_dir, "deliver")
        log = _outage_log(dsn, run_id)
    assert log["conflicts"] == 0
    assert log["dangling"] == 0
    assert len(log["spawns"]) == 1
    (spawn_id, spawn_seq) = log["spawns"][0]
    assert log["registered"] == [(spawn_id, spawn_seq)]
    [(parents, start_seq)] = log["starts"]
    assert parents == [spawn_id]
    assert start_seq > spawn_seq
    assert log["tools"] == 2


@pytest.mark.fault
@pytest.mark.multiprocess
def test_a_child_spawned_twice_during_an_outage_without_a_shared_file(tmp_path):
    """Two processes that share no queue directory (two hosts) each spawn the same child while
    PostgreSQL is down: the delivery that registers first stores its agent_spawn event; the
    other leaves its own out (counted in spawns_superseded), so no conflict is stored and the
    child's agent_start names the stored spawn event."""
    from durable_support import restartable_server

    run_id = f"spawns-{uuid.uuid4().hex[:10]}"
    with restartable_server() as server:
        dsn = server.new_database()
        server.stop()
        try:
            _outage_step(dsn, run_id, tmp_path / "first", "spawn")
            _outage_step(dsn, run_id, tmp_path / "second", "retry")
        finally:
            server.start()
        first = _outage_step(dsn, run_id, tmp_path / "first", "deliver")
        second = _outage_step(dsn, run_id, tmp_path / "second", "deliver")
        log = _outage_log(dsn, run_id)
    assert log["conflicts"] == 0
    assert log["dangling"] == 0
    assert len(log["spawns"]) == 1
    assert log["registered"] == log["spawns"]
    assert (first["spawns_superseded"], second["spawns_superseded"]) == (0, 1)
    [(parents, _)] = log["starts"]
    assert parents == [log["spawns"][0][0]]
    assert log["tools"] == 2
