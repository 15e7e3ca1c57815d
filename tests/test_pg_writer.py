"""EventWriter: deduplicated, conflict-preserving, atomic batch writes."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres import writer as writer_module
from otel_agentcap.exporters.postgres.errors import ConnectionFailed, WriteFailed
from otel_agentcap.exporters.postgres.rows import prepare
from otel_agentcap.exporters.postgres.store import conflicts_count, run_agents, run_events
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult
from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, event_id_for, validate_id

pytestmark = pytest.mark.storage

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def ev(
    run: str, agent: str, seq: int, key: str | None = None, payload: Any = None, **kw: Any
) -> Event:
    key = key or f"k{seq}"
    return Event(
        event_id=kw.pop("event_id", event_id_for(run, agent, key)),
        run_id=run,
        agent_id=agent,
        seq=seq,
        event_type=kw.pop("event_type", "model_call"),
        idempotency_key=key,
        wall_time=T0 + timedelta(seconds=seq),
        payload={"seq": seq} if payload is None else payload,
        **kw,
    )


@pytest.fixture()
def pool(pg_dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(pg_dsn, min_size=1, max_size=4, open=True) as p:
        yield p


def count(pool: ConnectionPool[Any], table: str) -> int:
    with pool.connection() as conn:
        row = conn.execute(f"SELECT count(*) FROM agentcap.{table}").fetchone()
    assert row is not None
    return int(row[0])


def test_same_batch_twice_is_stored_once(pool: ConnectionPool[Any]) -> None:
    """Writing a batch again stores nothing new and counts every row as a duplicate."""
    batch = Batch(tuple(ev("r", "a", i) for i in range(50)), (AgentRecord("r", "a", name="A"),))
    writer = EventWriter(pool)
    first = writer.write(batch)
    second = writer.write(batch)
    assert (first.inserted, first.duplicates, first.conflicts) == (50, 0, 0)
    assert (second.inserted, second.duplicates, second.conflicts) == (0, 50, 0)
    assert count(pool, "events") == 50
    assert count(pool, "conflicts") == 0


def test_repeats_inside_one_batch_are_duplicates(pool: ConnectionPool[Any]) -> None:
    """An event repeated within a batch is stored once and counted as a duplicate."""
    e = ev("r", "a", 1)
    result = EventWriter(pool).write(Batch((e, e, e)))
    assert (result.inserted, result.duplicates, result.conflicts) == (1, 2, 0)


def test_same_batch_from_two_writers_concurrently_is_stored_once(pg_dsn: str) -> None:
    """Two writers (own pools) racing with overlapping batches store each event exactly once."""
    batches = [
        Batch(tuple(ev("r", f"agent-{i % 4}", i) for i in range(j, j + 400))) for j in (0, 200)
    ]
    results: list[Any] = []
    barrier = threading.Barrier(4)

    def run(batch: Batch) -> None:
        with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as p:
            writer = EventWriter(p)
            barrier.wait()
            results.append(writer.write(batch))
            results.append(writer.write(batch))

    threads = [threading.Thread(target=run, args=(b,)) for b in batches + batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.inserted for r in results) == 600
    assert sum(r.conflicts for r in results) == 0
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM agentcap.events").fetchone() == (600,)


def test_collision_on_sequence_goes_to_conflicts(pool: ConnectionPool[Any]) -> None:
    """A different event on a stored (run, agent, seq) is kept in conflicts, not dropped."""
    writer = EventWriter(pool)
    stored = ev("r", "a", 5, key="first")
    writer.write(Batch((stored, ev("r", "a", 6))))
    other = ev("r", "a", 5, key="second", payload={"different": True})
    result = writer.write(Batch((other, ev("r", "a", 7))))
    assert (result.inserted, result.conflicts) == (1, 1)
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT reason, existing_event_id::text, event_id::text, idempotency_key, payload"
            " FROM agentcap.conflicts"
        ).fetchone()
    assert row == ("run_agent_seq", stored.event_id, other.event_id, "second", {"different": True})


def test_event_id_that_is_not_derived_from_run_agent_and_key_is_rejected(
    pool: ConnectionPool[Any],
) -> None:
    """An event whose id is not uuid5(run, agent, key), as a forged span would carry to take a
    stored event's place or another run's id, is left out and counted; the stored event and the
    rest of the batch are kept."""
    writer = EventWriter(pool)
    stored = ev("r", "a", 1, key="tool-call-1")
    writer.write(Batch((stored,)))
    another_key = ev("r", "a", 2, key="tool-call-1", event_id=str(uuid.uuid4()))
    another_run = ev("r2", "a", 1, key="tool-call-1", event_id=stored.event_id)
    result = writer.write(Batch((another_key, another_run, ev("r", "a", 3))))
    assert (result.inserted, result.conflicts, result.rejected) == (1, 0, 2)
    assert count(pool, "events") == 2
    assert count(pool, "conflicts") == 0


def test_same_event_id_with_other_content_goes_to_conflicts(pool: ConnectionPool[Any]) -> None:
    """A re-sent event id whose content changed is recorded as a conflict, once per distinct row."""
    writer = EventWriter(pool)
    writer.write(Batch((ev("r", "a", 1, payload={"v": 1}),)))
    changed = Batch((ev("r", "a", 1, payload={"v": 2}),))
    assert writer.write(changed).conflicts == 1
    assert writer.write(changed).conflicts == 1
    assert count(pool, "conflicts") == 1
    assert count(pool, "events") == 1


def test_collisions_inside_one_batch_go_to_conflicts(pool: ConnectionPool[Any]) -> None:
    """Two different events on the same (run, agent, seq) in one batch: one stored, one kept."""
    a = ev("r", "a", 3, key="x")
    b = ev("r", "a", 3, key="y")
    result = EventWriter(pool).write(Batch((a, b)))
    assert (result.inserted, result.conflicts) == (1, 1)
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT reason, existing_event_id::text FROM agentcap.conflicts"
        ).fetchone()
    assert row == ("run_agent_seq", a.event_id)


def test_unknown_event_type_is_rejected(pool: ConnectionPool[Any]) -> None:
    """An event type outside the known set does not fail the batch; it is left out and counted."""
    result = EventWriter(pool).write(
        Batch((ev("r", "a", 1, event_type="telepathy"), ev("r", "a", 2)))
    )
    assert (result.inserted, result.conflicts, result.rejected) == (1, 0, 1)


def test_invalid_event_id_is_rejected_alone(pool: ConnectionPool[Any]) -> None:
    """An event id that is not a UUID is left out; the rest of the batch is stored."""
    result = EventWriter(pool).write(
        Batch((ev("r", "a", 1, event_id="not-a-uuid"), ev("r", "a", 2)))
    )
    assert (result.inserted, result.rejected) == (1, 1)
    assert count(pool, "events") == 1


@pytest.mark.fault
def test_failed_batch_rolls_back_and_writer_stays_usable(pool: ConnectionPool[Any]) -> None:
    """A batch rejected by the server stores nothing (not even its agents) and the next one lands."""
    with pool.connection() as conn:
        conn.execute(
            """
            CREATE FUNCTION agentcap.fail_on_poison() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.payload ? 'poison' THEN RAISE EXCEPTION 'poisoned' USING ERRCODE = '23514'; END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER poison BEFORE INSERT ON agentcap.events
                FOR EACH ROW EXECUTE FUNCTION agentcap.fail_on_poison();
            """
        )
    writer = EventWriter(pool)
    bad = Batch(
        (ev("r", "a", 1), ev("r", "a", 2, payload={"poison": 1})),
        (AgentRecord("r", "a", name="A"),),
        (RunRecord("r", T0),),
    )
    with pytest.raises(WriteFailed):
        writer.write(bad)
    assert count(pool, "events") == 0
    assert count(pool, "agents") == 0
    assert count(pool, "runs") == 0
    assert writer.write(Batch((ev("r", "a", 3),))).inserted == 1


@pytest.mark.fault
def test_killed_connection_rolls_back_and_writer_recovers(pool: ConnectionPool[Any]) -> None:
    """A backend killed mid-batch loses the whole batch, raises ConnectionFailed, and the writer
    writes the next batch on a fresh connection."""
    with pool.connection() as conn:
        conn.execute(
            """
            CREATE FUNCTION agentcap.kill_self() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.payload ? 'kill' THEN PERFORM pg_terminate_backend(pg_backend_pid()); END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER kill BEFORE INSERT ON agentcap.events
                FOR EACH ROW EXECUTE FUNCTION agentcap.kill_self();
            """
        )
    writer = EventWriter(pool, max_attempts=2)
    with pytest.raises(ConnectionFailed):
        writer.write(Batch((ev("r", "a", 1), ev("r", "a", 2, payload={"kill": 1}))))
    assert count(pool, "events") == 0
    with pool.connection() as conn:
        conn.execute("DROP TRIGGER kill ON agentcap.events")
    result = writer.write(Batch((ev("r", "a", 1), ev("r", "a", 2, payload={"kill": 1}))))
    assert result.inserted == 2


def test_awkward_payloads_and_text_land(pool: ConnectionPool[Any]) -> None:
    """NUL, NaN, infinities, bytes, lone surrogates and a 5 MB payload are all stored."""
    payloads = [
        {"nul": "a\x00b"},
        {"nan": float("nan"), "inf": float("-inf")},
        {"bytes": b"\x00\xff\xfe"},
        {"surrogate": "bad \udcff utf-8"},
        {"huge": "x" * 5_000_000},
        ["list", 1, None, {"nested": {1: "int key"}}],
        "a\x00plain string",
        object(),
    ]
    events = tuple(ev("r", "a", i, payload=p) for i, p in enumerate(payloads))
    events += (
        ev(
            "r",
            "a",
            99,
            key="key with \u00fc and spaces",
            trace_id="t\x00",
            span_id="00f067aa0ba902b7",
        ),
    )
    writer = EventWriter(pool)
    result = writer.write(Batch(events))
    assert result.inserted == len(events)
    assert writer.write(Batch(events)).duplicates == len(events)
    with pool.connection() as conn:
        stored = run_events(conn, "r")
    by_seq = {e.seq: e.payload for e in stored}
    assert by_seq[0] == {"nul": {"$agentcap.str": "YQBi"}}
    assert by_seq[1] == {"nan": {"$agentcap.float": "NaN"}, "inf": {"$agentcap.float": "-Infinity"}}
    assert by_seq[2] == {"bytes": {"$agentcap.bytes": "AP/+"}}
    assert len(by_seq[4]["huge"]) == 5_000_000


@pytest.mark.parametrize(
    "run_id,agent_id",
    [("planner-run", "planner"), ("ünï code/ids with spaces", "ägent \U0001d538 / x")],
)
def test_non_uuid_run_and_agent_ids_land(
    pool: ConnectionPool[Any], run_id: str, agent_id: str
) -> None:
    """Any string works as run or agent id; reads give it back unchanged."""
    batch = Batch(
        (ev(run_id, agent_id, 1),),
        (
            AgentRecord(
                run_id,
                agent_id,
                name=agent_id,
                parent_agent_id="root agent",
                spawned_at_event_id=event_id_for(run_id, "root agent", f"spawn:{agent_id}"),
                lineage_known=True,
            ),
        ),
        (RunRecord(run_id, T0, {"who": "test"}),),
    )
    assert EventWriter(pool).write(batch).inserted == 1
    with pool.connection() as conn:
        events = run_events(conn, run_id)
        agents = run_agents(conn, run_id)
    assert [(e.run_id, e.agent_id) for e in events] == [(run_id, agent_id)]
    assert [(a.agent_id, a.parent_agent_id) for a in agents] == [(agent_id, "root agent")]


def test_the_longest_ids_validate_id_accepts_land(pool: ConnectionPool[Any]) -> None:
    """Run, agent and invocation ids of 512 bytes of four-byte characters, in the idempotency key
    of a retried tool invocation, fit PostgreSQL's index entries."""
    longest = validate_id("\U0001d538" * 128, "id")
    run_id, agent_id = f"r{longest[1:]}", f"a{longest[1:]}"
    key = f"tool:{longest}\x1fattempt2:invocation"
    batch = Batch(
        (ev(run_id, agent_id, 1, key=key, event_type="tool_invocation"),),
        (
            AgentRecord(
                run_id,
                agent_id,
                name=agent_id,
                parent_agent_id=longest,
                spawned_at_event_id=event_id_for(run_id, longest, f"spawn:{agent_id}"),
                lineage_known=True,
            ),
        ),
        (RunRecord(run_id, T0, {}),),
    )
    assert EventWriter(pool).write(batch).inserted == 1
    with pool.connection() as conn:
        assert [e.idempotency_key for e in run_events(conn, run_id)] == [key]


def test_agents_and_runs_first_writer_wins(pool: ConnectionPool[Any]) -> None:
    """Later records fill what a stored agent or run does not know yet (a name, a lineage, the
    run's attributes) but never change what it knows: a different name, lineage, start or
    attribute declaration is kept in record_conflicts with a reason, once however often it is
    sent."""
    writer = EventWriter(pool)
    spawn = ev("r", "parent", 1, key="spawn:child", event_type="agent_spawn")
    child_lineage = dict(parent_agent_id="parent", spawned_at_event_id=spawn.event_id)
    # The child's own events come first: its name is known, its lineage not yet.
    writer.write(
        Batch(
            (ev("r", "child", 3),),
            (AgentRecord("r", "child", name="worker"),),
            (RunRecord("r", T0 + timedelta(hours=1)),),
        )
    )
    # Its parent's spawn brings the lineage; the run's executions declare its attributes.
    writer.write(
        Batch(
            (spawn,),
            (
                AgentRecord("r", "parent", name="parent", lineage_known=True),
                AgentRecord("r", "child", name="worker", lineage_known=True, **child_lineage),
            ),
            (RunRecord("r", T0, {"a": 1}),),
        )
    )
    forged = Batch(
        (),
        (
            AgentRecord("r", "child", name="renamed"),
            AgentRecord(
                "r",
                "parent",
                lineage_known=True,
                parent_agent_id="child",
                spawned_at_event_id=event_id_for("r", "child", "spawn:parent"),
            ),
        ),
        (RunRecord("r", T0 - timedelta(days=365), {"a": 2, "b": 3}),),
    )
    first = writer.write(forged)
    again = writer.write(forged)
    assert (first.record_conflicts, first.rejected_records) == (3, 0)
    assert again.record_conflicts == 3
    with pool.connection() as conn:
        agents = {a.agent_id: a for a in run_agents(conn, "r")}
        run = conn.execute("SELECT started_at, attributes FROM agentcap.runs").fetchone()
        recorded = conn.execute(
            "SELECT agent_id, reason, stored, offered FROM agentcap.record_conflicts"
            " ORDER BY reason"
        ).fetchall()
    child, parent = agents["child"], agents["parent"]
    assert (child.name, child.parent_agent_id, child.spawned_at_event_id) == (
        "worker",
        "parent",
        spawn.event_id,
    )
    assert (parent.parent_agent_id, parent.spawned_at_event_id) == (None, None)
    assert run == (T0 + timedelta(seconds=3), {"a": 1})  # the first batch's earliest event
    assert recorded == [
        (
            "parent",
            "agent_lineage",
            {"parent_agent_id": None, "spawned_at_event_id": None},
            {
                "parent_agent_id": "child",
                "spawned_at_event_id": event_id_for("r", "child", "spawn:parent"),
            },
        ),
        ("child", "agent_name", "worker", "renamed"),
        (None, "run_attributes", {"a": 1}, {"a": 2, "b": 3}),
    ]


def test_records_with_invalid_ids_are_rejected(pool: ConnectionPool[Any]) -> None:
    """Agent and run records with empty ids, a spawn link that is not the parent's spawn event,
    or a parent without a known lineage are left out and counted; no ('', '') agent or '' run
    row appears."""
    writer = EventWriter(pool)
    result = writer.write(
        Batch(
            (ev("r", "a", 1),),
            (
                AgentRecord("", ""),
                AgentRecord("r", "b", parent_agent_id="a", lineage_known=False),
                AgentRecord(
                    "r",
                    "c",
                    parent_agent_id="a",
                    spawned_at_event_id=str(uuid.uuid4()),
                    lineage_known=True,
                ),
            ),
            (RunRecord("", T0), RunRecord("r", datetime(1970, 1, 1, tzinfo=UTC))),
        )
    )
    assert (result.inserted, result.rejected_records) == (1, 5)
    with pool.connection() as conn:
        assert conn.execute("SELECT run_id, agent_id FROM agentcap.agents").fetchall() == [
            ("r", "a")
        ]
        assert conn.execute("SELECT run_id FROM agentcap.runs").fetchall() == [("r",)]


event_strategy = st.builds(
    lambda agent, seq, payload: ev("r", f"agent-{agent}", seq, payload={"p": payload}),
    st.integers(0, 2),
    st.integers(0, 30),
    st.integers(0, 3),
)


def _write(writer: EventWriter, batch: Batch, direct: bool) -> WriteResult:
    """Write ``batch`` by the staging path, or try the direct COPY first."""
    return writer.write_prepared(prepare(batch), direct=direct)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@pytest.mark.parametrize("direct", [False, True])
@given(batches=st.lists(st.lists(event_strategy, max_size=12), min_size=1, max_size=5))
def test_dedup_invariant(
    pool: ConnectionPool[Any], direct: bool, batches: list[list[Event]]
) -> None:
    """Any sequence of batches with repeats stores exactly the first copy of each distinct event;
    every other distinct row is either a counted duplicate or a recorded conflict; the same
    whether each batch first tries the direct COPY or not."""
    with pool.connection() as conn:
        conn.execute("TRUNCATE agentcap.events, agentcap.conflicts, agentcap.agents, agentcap.runs")
    writer = EventWriter(pool, staging_name="staging_hypothesis")
    for batch in batches + batches[:2]:
        _write(writer, Batch(tuple(batch)), direct)
    # Expected: the first event to claim each (agent, seq) wins; ids derive from (agent, key=seq),
    # so a later event with the same id but another payload is a conflict, never a second row.
    expected: dict[tuple[str, int], Event] = {}
    order = sorted(
        ((b_i, e) for b_i, batch in enumerate(batches) for e in batch),
        key=lambda x: (x[0], x[1].agent_id, x[1].seq),
    )
    for _, e in order:
        expected.setdefault((e.agent_id, e.seq), e)
    with pool.connection() as conn:
        stored = {(e.agent_id, e.seq): e.payload for e in run_events(conn, "r")} if expected else {}
        n_conflicts = conflicts_count(conn)
    assert stored == {k: e.payload for k, e in expected.items()}
    distinct_others = {(e.agent_id, e.seq, e.payload["p"]) for b in batches for e in b} - {
        (e.agent_id, e.seq, e.payload["p"]) for e in expected.values()
    }
    assert n_conflicts == len(distinct_others)


@pytest.mark.storage
def test_stored_copy_behind_an_in_batch_collision_is_a_duplicate(pool):
    """A batch re-sending a stored event behind a different event with the same id records one
    conflict (the different one), not two."""
    writer = EventWriter(pool)
    try:
        writer.write(Batch((ev("r", "agent-0", 0, payload={"p": 1}),)))
        result = writer.write(
            Batch(
                (ev("r", "agent-0", 0, payload={"p": 0}), ev("r", "agent-0", 0, payload={"p": 1}))
            )
        )
    finally:
        writer.close()
    assert (result.inserted, result.duplicates, result.conflicts) == (0, 1, 1)


@pytest.mark.storage
@pytest.mark.fault
def test_staging_tables_of_dead_processes_are_dropped(pool, pg_dsn):
    """A new writer drops staging tables left by dead processes of this host, and keeps those of
    live processes and of other hosts."""
    import subprocess

    from otel_agentcap.exporters.postgres.writer import _host_tag

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag = _host_tag()
    names = {
        "dead": f"staging_{tag}_{dead.pid}_aaaaaaaaaaaa",
        "live": f"staging_{tag}_1_bbbbbbbbbbbb",
        "other_host": f"staging_00000000_{dead.pid}_cccccccccccc",
    }
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f"CREATE UNLOGGED TABLE agentcap.{name} (x int)")
    writer = EventWriter(pool)
    try:
        writer.write(Batch((ev("r", "agent-0", 1),)))
    finally:
        writer.close()
    with psycopg.connect(pg_dsn) as conn:
        left = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'agentcap' "
                "AND tablename LIKE 'staging%%'"
            )
        }
    assert names["dead"] not in left
    assert {names["live"], names["other_host"]} <= left


def call(
    run: str, agent: str, seq: int, response_id: str | None = None, request_id: str | None = None
) -> Event:
    """A model_call event with the ids its payload records (absent when None)."""
    payload: dict[str, Any] = {"schema": 1, "status": "ok" if response_id else "error"}
    if response_id is not None:
        payload["response_id"] = response_id
    if request_id is not None:
        payload["request_id"] = request_id
    return ev(run, agent, seq, key=f"seq:{seq}", payload=payload)


def conflict_rows(pool: ConnectionPool[Any]) -> list[tuple[str, str, str | None]]:
    with pool.connection() as conn:
        rows = conn.execute(
            "SELECT event_id::text, reason, existing_event_id::text FROM agentcap.conflicts"
            " ORDER BY conflict_id"
        ).fetchall()
    return [(str(r[0]), str(r[1]), r[2]) for r in rows]


def test_model_call_stored_under_another_event_id_is_a_conflict(pool):
    """A second model_call event of a stored call (same run and response id, another event id) is
    refused as an event and kept in agentcap.conflicts; re-sending it records it once."""
    writer = EventWriter(pool)
    first = call("r", "a", 1, "msg_1", "req_1")
    second = call("r", "b", 7, "msg_1", "req_1")
    assert writer.write(Batch((first,))).inserted == 1
    result = writer.write(Batch((second, call("r", "a", 2, "msg_2", "req_2"))))
    assert (result.inserted, result.duplicates, result.conflicts) == (1, 0, 1)
    assert writer.write(Batch((second,))).conflicts == 1
    assert count(pool, "events") == 2
    assert conflict_rows(pool) == [(second.event_id, "model_call_response_id", first.event_id)]


def test_model_call_without_response_id_is_matched_by_request_id(pool):
    """Error responses have no response id: a second record of one is found by its request id,
    while another failed call (another request id) is an event of its own."""
    writer = EventWriter(pool)
    first = call("r", "a", 1, request_id="req_err")
    writer.write(Batch((first,)))
    result = writer.write(Batch((call("r", "b", 1, request_id="req_err"),)))
    assert (result.inserted, result.conflicts) == (0, 1)
    assert writer.write(Batch((call("r", "a", 2, request_id="req_err2"),))).inserted == 1
    assert [row[1:] for row in conflict_rows(pool)] == [("model_call_request_id", first.event_id)]


def test_same_response_id_in_another_run_is_another_event(pool):
    """Call identity is per run: the same response id in two runs is stored twice."""
    writer = EventWriter(pool)
    writer.write(Batch((call("r1", "a", 1, "msg_1", "req_1"),)))
    result = writer.write(Batch((call("r2", "a", 1, "msg_1", "req_1"),)))
    assert (result.inserted, result.conflicts) == (1, 0)
    assert count(pool, "conflicts") == 0


def test_model_call_twice_in_one_batch_is_one_event(pool):
    """Two events of one call in one batch (as a Batch built by hand has them, and as the
    mapping's superseded events are) store one event and one conflict; the batch never fails."""
    writer = EventWriter(pool)
    a, b = call("r", "a", 1, "msg_1", "req_1"), call("r", "b", 1, "msg_1")
    c = call("r", "c", 1, None, "req_1")
    result = writer.write(Batch((a, b)))
    assert (result.inserted, result.conflicts) == (1, 1)
    result = writer.write(Batch((), superseded=(c,)))
    assert (result.inserted, result.conflicts) == (0, 1)
    reasons = {row[0]: row[1:] for row in conflict_rows(pool)}
    assert reasons == {
        b.event_id: ("model_call_response_id", a.event_id),
        c.event_id: ("model_call_request_id", a.event_id),
    }


def test_concurrent_writers_store_one_event_per_model_call(pg_dsn):
    """Writers racing to store records of one call under different event ids: one event, the
    others conflicts, no failed batch (a unique violation is classified again)."""
    barrier = threading.Barrier(4)
    results: list[Any] = []

    def write(agent: str) -> None:
        with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as p:
            writer = EventWriter(p)
            writer.write(Batch())
            barrier.wait()
            results.append(writer.write(Batch((call("r", agent, 1, "msg_1", "req_1"),))))
            writer.close()

    threads = [threading.Thread(target=write, args=(f"agent-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    assert sum(r.inserted for r in results) == 1
    assert sum(r.conflicts for r in results) == 3
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM agentcap.events").fetchone()
    assert row == (1,)


call_strategy = st.builds(
    call,
    st.sampled_from(["r1", "r2"]),
    st.sampled_from(["a", "b"]),
    st.integers(0, 5),
    st.sampled_from([None, "msg_1", "msg_2"]),
    st.sampled_from([None, "req_1", "req_2"]),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@pytest.mark.parametrize("direct", [False, True])
@given(batches=st.lists(st.lists(call_strategy, max_size=8), min_size=1, max_size=4))
def test_model_call_dedup_invariant(
    pool: ConnectionPool[Any], direct: bool, batches: list[list[Event]]
) -> None:
    """Any batches of model calls: every write succeeds, no two stored events of a run share a
    response id or a request id, and every distinct event is stored, a conflict or a duplicate;
    the same whether each batch first tries the direct COPY or not."""
    with pool.connection() as conn:
        conn.execute("TRUNCATE agentcap.events, agentcap.conflicts, agentcap.agents, agentcap.runs")
    writer = EventWriter(pool, staging_name="staging_hypothesis_calls")
    for batch in batches + batches[:1]:
        _write(writer, Batch(tuple(batch)), direct)
    with pool.connection() as conn:
        stored = conn.execute(
            "SELECT run_id, payload->>'response_id', payload->>'request_id' FROM agentcap.events"
        ).fetchall()
        stored_ids = {str(r[0]) for r in conn.execute("SELECT event_id FROM agentcap.events")}
        conflict_ids = {str(r[0]) for r in conn.execute("SELECT event_id FROM agentcap.conflicts")}
    for column in (1, 2):
        keys = [(r[0], r[column]) for r in stored if r[column] is not None]
        assert len(keys) == len(set(keys))
    assert {e.event_id for b in batches for e in b} <= stored_ids | conflict_ids


def test_model_call_ids_that_are_not_str_are_matched_as_stored(pool):
    """A response id given as a uuid.UUID is stored as a JSON string, so the log's unique index
    sees it: two such events of one call in one batch are one event and one conflict, and the
    batch is written rather than failing on the index."""
    response_id = uuid.uuid4()
    first = ev("r", "a", 1, payload={"response_id": response_id})
    second = ev("r", "b", 1, payload={"response_id": response_id})
    result = EventWriter(pool).write(Batch((first, second)))
    assert (result.inserted, result.conflicts) == (1, 1)
    assert count(pool, "events") == 1


def test_reason_of_a_conflict_does_not_depend_on_the_classifying_variant(pool):
    """A model_call row that repeats a stored call and also collides on (run, agent, seq) is filed
    under the same reason whether the fast or the full classification saw it, so sending it again
    adds no second conflicts row."""
    writer = EventWriter(pool)
    stored_call = call("r", "a", 1, "msg_1")
    at_seq = ev("r", "b", 5)
    other = ev("r", "c", 7, key="other")
    writer.write(Batch((stored_call, at_seq, other)))
    twin = call("r", "b", 5, "msg_1")  # the call of stored_call, at the seq of at_seq
    assert writer.write(Batch((twin,))).conflicts == 1
    # This row collides on (run, agent, seq) only: the fast variant cannot see that, the insert
    # fails, and the batch is classified again with the full variant.
    forces_full = ev("r", "c", 7)
    writer.write(Batch((twin, forces_full)))
    with pool.connection() as conn:
        filed = conn.execute(
            "SELECT reason FROM agentcap.conflicts WHERE event_id = %s", (twin.event_id,)
        ).fetchall()
    assert filed == [("model_call_response_id",)]


def test_direct_copy_of_new_rows_stores_them_without_staging(pool):
    """A batch of new rows written with direct=True lands in one attempt (its run's partition
    exists), with its runs and agents, and this writer never creates a staging table."""
    from otel_agentcap.exporters.postgres import partitions

    with pool.connection() as conn:
        partitions.ensure_partitions(conn, [T0])
    writer = EventWriter(pool)
    batch = Batch(
        tuple(ev("r", "a", i) for i in range(20)),
        (AgentRecord("r", "a", name="A"),),
        (RunRecord("r", T0, {"k": 1}),),
    )
    result = _write(writer, batch, True)
    assert (result.inserted, result.duplicates, result.conflicts, result.attempts) == (20, 0, 0, 1)
    with pool.connection() as conn:
        staging = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE tablename = %s", (writer.staging_table[9:],)
        ).fetchone()
        run = conn.execute("SELECT attributes FROM agentcap.runs").fetchone()
        agents = [a.name for a in run_agents(conn, "r")]
    assert staging == (0,)
    assert run == ({"k": 1},)
    assert agents == ["A"]


@pytest.mark.parametrize(
    "second",
    [
        lambda: ev("r", "a", 3, key="other"),  # same (run, agent, seq), another event
        lambda: ev("r", "a", 30, key="k3"),  # same idempotency key, another seq
        lambda: ev("r", "a", 3),  # an exact repeat
        # Refused by the table's CHECK (validation, left out here, would reject it before).
        lambda: ev("r", "a", 31, event_type="not_a_type"),
    ],
)
def test_direct_copy_that_collides_is_classified_row_by_row(pool, second):
    """A direct COPY that meets a stored row (or a row the table refuses) stores nothing by
    itself: the batch is classified as on the staging path, so a different event is kept in
    conflicts, a repeat counted as a duplicate, and the batch's new rows still land."""
    writer = EventWriter(pool)
    _write(writer, Batch((ev("r", "a", 3),)), True)
    fresh = ev("r", "b", 1)
    result = writer.write_prepared(prepare(Batch((fresh, second())), validated=True), direct=True)
    assert result.inserted == 1
    assert result.duplicates + result.conflicts == 1
    assert count(pool, "events") == 2
    assert count(pool, "conflicts") == result.conflicts


def test_copy_data_built_for_one_path_serves_the_path_the_batch_takes(pool):
    """COPY data the caller built for the direct path, for a batch that cannot take it (two of
    its rows collide), is not fed to the staging table: the batch is stored, the collision
    kept as a conflict."""
    from otel_agentcap.exporters.postgres.rows import copy_data

    prepared = prepare(Batch((ev("r", "a", 1), ev("r", "a", 1, key="other"))))
    starts = {"r": prepared.runs[0][1]}
    data = copy_data(prepared.events, staging=False, starts=starts)
    result = EventWriter(pool).write_prepared(prepared, direct=True, data=data, starts=starts)
    assert (result.inserted, result.conflicts) == (1, 1)


@pytest.mark.parametrize("staging", [False, True])
def test_copy_data_round_trips_every_column(pool, staging):
    """Rows sent as prebuilt binary COPY data read back with every value as it was: ids, text
    with non-ASCII characters, a sequence near the bigint limit, time to the microsecond, parent
    ids, trace and span ids, NULLs, and the JSON payload."""
    from otel_agentcap.exporters.postgres.rows import copy_data

    when = datetime(2024, 7, 9, 13, 14, 15, 123456, tzinfo=UTC)
    parent = event_id_for("r", "a", "p")
    event = Event(
        event_id=event_id_for("r", "\u00e9-agent", "k"),
        run_id="r",
        agent_id="\u00e9-agent",
        seq=2**62,  # above what validation accepts today: the batch says it was validated
        event_type="tool_result",
        idempotency_key="k \U0001f600",
        wall_time=when,
        causal_parent_ids=(parent,),
        payload={"x": [1, "\u00e9"], "none": None},
        trace_id="0af7651916cd43dd8448eb211c80319c",
        span_id=None,
    )
    prepared = prepare(Batch((event,)), validated=True)
    writer = EventWriter(pool)
    starts = {"r": when}  # the run's start: its only event's time
    data = copy_data(prepared.events, staging=staging, starts=starts)
    sent: list[bytes] = []
    usable = writer_module._usable

    def spy(prebuilt: Any, *args: Any, **kwargs: Any) -> bytes | None:
        sent.append(usable(prebuilt, *args, **kwargs))
        return sent[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer_module, "_usable", spy)
        result = writer.write_prepared(prepared, direct=not staging, data=data, starts=starts)
    assert sent == [data]  # the prebuilt data itself went to the server
    assert result.inserted == 1
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT event_id::text, agent_id, logical_seq, wall_time, event_type,"
            " causal_parent_ids::text[], idempotency_key, trace_id, span_id, payload,"
            " run_started_at FROM agentcap.events"
        ).fetchone()
    assert row == (
        event.event_id,
        "\u00e9-agent",
        2**62,
        when,
        "tool_result",
        [parent],
        "k \U0001f600",
        "0af7651916cd43dd8448eb211c80319c",
        None,
        {"x": [1, "\u00e9"], "none": None},
        when,
    )


def test_span_envelopes_through_the_direct_path_keep_the_first_writer(pool):
    """Span envelopes copied straight in with a batch of new events; the same batch again, and
    an envelope of the same span with another end, fall back to the staging path: nothing is
    stored twice and the first envelope stays."""
    from otel_agentcap.model import SpanRecord

    def envelope(end_seconds: int) -> SpanRecord:
        return SpanRecord(
            "r",
            "0af7651916cd43dd8448eb211c80319c",
            "00f067aa0ba902b7",
            None,
            "invoke_agent a",
            0,
            T0,
            T0 + timedelta(seconds=end_seconds),
        )

    writer = EventWriter(pool)
    first = Batch((ev("r", "a", 1),), spans=(envelope(5),))
    assert _write(writer, first, True).inserted == 1
    assert _write(writer, first, True).duplicates == 1
    later = Batch((ev("r", "a", 2),), spans=(envelope(9),))
    assert _write(writer, later, True).inserted == 1
    with pool.connection() as conn:
        rows = conn.execute("SELECT end_time FROM agentcap.spans").fetchall()
    assert rows == [(T0 + timedelta(seconds=5),)]


def test_an_event_id_is_unique_within_its_run(pool: ConnectionPool[Any]) -> None:
    """The log's key is (run_id, event_id): the same id in another run is another event, in one
    batch or in two, while a second copy in the same run is still a conflict. (Validation refuses
    an id that is not derived from its run, agent and key; the batches here skip it to show that
    the storage itself is keyed by run.)"""
    writer = EventWriter(pool)
    a = ev("r1", "a", 1)
    b = a._replace(run_id="r2", payload={"other": "run"})
    c = a._replace(payload={"same": "run, other content"}, seq=2, idempotency_key="k2")
    result = writer.write(Batch((a, b)), validated=True)
    assert (result.inserted, result.conflicts) == (2, 0)
    assert writer.write(Batch((b._replace(run_id="r3"),)), validated=True).inserted == 1
    assert writer.write(Batch((c,)), validated=True).conflicts == 1
    with pool.connection() as conn:
        rows = conn.execute(
            "SELECT run_id FROM agentcap.events WHERE event_id = %s ORDER BY 1", (a.event_id,)
        ).fetchall()
    assert rows == [("r1",), ("r2",), ("r3",)]


def test_direct_copy_creates_the_partition_of_a_new_run_start(pool):
    """A direct COPY of a run whose start no partition holds yet: the partition is created for
    every run-partitioned table, and the events and span envelopes land in it."""
    from otel_agentcap.model import SpanRecord

    start = datetime(2025, 6, 9, 8, 0, tzinfo=UTC)
    envelope = SpanRecord("june", "1" * 32, "2" * 16, None, "invoke_agent a", 0, start, start)
    batch = Batch(
        tuple(ev("june", "a", i)._replace(wall_time=start) for i in range(5)),
        runs=(RunRecord("june", start),),
        spans=(envelope,),
    )
    result = _write(EventWriter(pool), batch, True)
    assert (result.inserted, result.expired) == (5, 0)
    with pool.connection() as conn:
        where = {
            table: conn.execute(
                f"SELECT DISTINCT tableoid::regclass::text, run_started_at FROM agentcap.{table}"
            ).fetchall()
            for table in ("events", "spans")
        }
    assert where == {
        "events": [("agentcap.events_p20250601", start)],
        "spans": [("agentcap.spans_p20250601", start)],
    }


@pytest.mark.parametrize("direct", [True, False])
def test_copy_data_built_with_another_start_is_built_again(pool, direct):
    """COPY data built ahead with a start that is not the run's stored one (a stale cache, a run
    another process stored first) is not sent: the rows are built again with the stored start,
    so every row of the run stays in its run's partition."""
    from otel_agentcap.exporters.postgres.rows import copy_data, span_copy_data
    from otel_agentcap.model import SpanRecord

    writer = EventWriter(pool)
    writer.write(Batch((ev("r", "a", 0),), runs=(RunRecord("r", T0),)))
    wrong = {"r": T0 + timedelta(days=40)}
    envelope = SpanRecord("r", "1" * 32, "3" * 16, None, "invoke_agent b", 0, T0, T0)
    prepared = prepare(Batch(tuple(ev("r", "b", i) for i in range(4)), spans=(envelope,)))
    result = writer.write_prepared(
        prepared,
        direct=direct,
        data=copy_data(prepared.events, staging=not direct, starts=wrong),
        span_data=span_copy_data(prepared.spans, starts=wrong),
        starts=wrong,
    )
    assert result.inserted == 4
    with pool.connection() as conn:
        starts = {
            row[0]
            for table in ("events", "spans")
            for row in conn.execute(f"SELECT DISTINCT run_started_at FROM agentcap.{table}")
        }
    assert starts == {T0}
    assert writer.run_starts.known(["r"]) == {"r": T0}


def test_direct_copy_of_a_pruned_run_is_expired(pg_dsn, pool):
    """After db prune, a direct COPY of a late batch of a pruned run stores nothing, creates no
    partition and counts its events as expired; the writer forgets the run's start."""
    from otel_agentcap.exporters.postgres import partitions, retention

    january = datetime(2025, 1, 10, tzinfo=UTC)
    writer = EventWriter(pool)
    writer.write(Batch((ev("jan", "a", 0)._replace(wall_time=january),)))
    assert writer.run_starts.known(["jan"]) == {"jan": january}
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        retention.prune(admin, datetime(2025, 2, 1, tzinfo=UTC))
    late = Batch(tuple(ev("jan", "a", i)._replace(wall_time=january) for i in range(1, 4)))
    result = _write(writer, late, True)
    assert (result.inserted, result.expired) == (0, 3)
    assert writer.run_starts.known(["jan"]) is None
    with pool.connection() as conn:
        lowers = [p.lower for p in partitions.list_partitions(conn, ["agentcap.events"])]
    assert datetime(2025, 1, 1, tzinfo=UTC) not in lowers
    assert count(pool, "events") == 0


def test_direct_batches_leave_the_analyze_to_the_first_staged_batch(pool, monkeypatch):
    """Batches of the direct path, which classify nothing, ask for no analyze of the partition
    they fill; the first batch of the staging path afterwards has it analyzed before it
    classifies, so its probes read one event each by the primary key, not the whole run."""
    from pg_log import assert_classification_probes_by_key

    from otel_agentcap.exporters.postgres import partitions

    start = datetime(2025, 2, 3, tzinfo=UTC)
    with pool.connection() as conn:
        partitions.ensure_partitions(conn, [start])
        conn.execute("ALTER TABLE agentcap.events_p20250201 SET (autovacuum_enabled = false)")
        conn.commit()

    def batch(first: int, size: int = 2_000) -> Batch:
        return Batch(
            tuple(
                ev("big", f"a{i % 8}", i // 8, key=f"seq:{i // 8}", payload={"n": "x" * 300})
                for i in range(first, first + size)
            ),
            runs=(RunRecord("big", start),),
        )

    calls: list[str] = []
    analyze = writer_module.analyze_partitions
    write_once = EventWriter._write_once

    def spy_analyze(conn: Any, starts: Any) -> int:
        calls.append("analyze")
        return analyze(conn, starts)

    def spy_write_once(self: EventWriter, *args: Any, **kwargs: Any) -> Any:
        calls.append("classify")
        return write_once(self, *args, **kwargs)

    monkeypatch.setattr(writer_module, "analyze_partitions", spy_analyze)
    monkeypatch.setattr(EventWriter, "_write_once", spy_write_once)

    def analyzed(conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT count(*) FROM pg_stats WHERE schemaname = 'agentcap'"
            " AND tablename = 'events_p20250201'"
        ).fetchone()
        assert row is not None
        return int(row[0])

    writer = EventWriter(pool)
    for first in range(0, 12_000, 2_000):
        assert _write(writer, batch(first), True).inserted == 2_000
    assert calls == []
    with pool.connection() as conn:
        assert analyzed(conn) == 0
    assert _write(writer, batch(12_000), False).inserted == 2_000
    assert calls[:2] == ["analyze", "classify"]
    with pool.connection() as wconn:
        assert analyzed(wconn) > 0
    assert_classification_probes_by_key(writer, batch(14_000), "big", start)
    writer.close()


@pytest.mark.parametrize("pipelines", [True, False])
@pytest.mark.parametrize("direct", [False, True])
def test_statements_before_the_copy_give_the_same_outcome_with_or_without_pipelines(
    pool, monkeypatch, pipelines, direct
):
    """The runs, agents and records that differ go to the server in pipelines where the libpq
    has them, one by one where it does not: either way a second batch that offers another run
    declaration and another agent name stores its events, keeps the first records and files
    both differences, and an expired run's records are neither stored nor filed."""
    monkeypatch.setattr(writer_module, "_PIPELINES", pipelines)
    writer = EventWriter(pool)
    first = Batch(
        (ev("r", "a", 1),),
        (AgentRecord("r", "a", name="A"),),
        (RunRecord("r", T0, {"k": 1}),),
    )
    assert _write(writer, first, direct).inserted == 1
    second = Batch(
        (ev("r", "a", 2), ev("r", "b", 1)),
        (AgentRecord("r", "a", name="other"), AgentRecord("r", "b", name="B")),
        (RunRecord("r", T0, {"k": 2}),),
    )
    result = _write(writer, second, direct)
    assert (result.inserted, result.record_conflicts) == (2, 2)
    with pool.connection() as conn:
        run = conn.execute("SELECT attributes FROM agentcap.runs WHERE run_id = 'r'").fetchone()
        names = sorted(a.name or "" for a in run_agents(conn, "r"))
        filed = conn.execute(
            "SELECT reason FROM agentcap.record_conflicts ORDER BY reason"
        ).fetchall()
    assert run == ({"k": 1},)
    assert names == ["A", "B"]
    assert filed == [("agent_name",), ("run_attributes",)]

    old = T0 - timedelta(days=400)
    with pool.connection() as conn:
        conn.execute(
            "UPDATE agentcap.log_settings SET pruned_before = %s", (T0 - timedelta(days=30),)
        )
        conn.commit()
    expired = Batch(
        (ev("gone", "a", 1),),
        (AgentRecord("gone", "a", name="X"),),
        (RunRecord("gone", old, {"k": 3}),),
    )
    result = _write(writer, expired, direct)
    assert (result.inserted, result.expired, result.record_conflicts) == (0, 1, 0)
    with pool.connection() as conn:
        assert conn.execute(
            "SELECT count(*) FROM agentcap.agents WHERE run_id = 'gone'"
        ).fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM agentcap.record_conflicts").fetchone() == (2,)


class _RecordingConnection(psycopg.Connection[Any]):
    """Keeps the text of every statement the writer executes (COPY aside)."""

    sent: ClassVar[list[str]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        text = query.decode() if isinstance(query, bytes) else str(query)
        _RecordingConnection.sent.append(text)
        return super().execute(query, params, **kwargs)


def _agent_statements() -> list[str]:
    return [
        s
        for s in _RecordingConnection.sent
        if "INSERT INTO agentcap.agents" in s or "record_conflicts" in s
    ]


def test_agents_met_before_skip_the_agents_statements(pg_dsn: str) -> None:
    """A batch naming only agent rows this writer stored and found equal before sends no agent
    statement; a record that differs still goes out, is filed and counted, every time."""
    _RecordingConnection.sent = []
    with ConnectionPool(
        pg_dsn, min_size=1, max_size=1, open=True, connection_class=_RecordingConnection
    ) as recording:
        writer = EventWriter(recording)
        named = (AgentRecord("r", "a", name="A"),)
        first = writer.write(Batch(tuple(ev("r", "a", i) for i in range(3)), named))
        assert first.inserted == 3 and _agent_statements()

        _RecordingConnection.sent = []
        again = writer.write(Batch(tuple(ev("r", "a", i) for i in range(3, 6)), named))
        assert again.inserted == 3 and again.record_conflicts == 0
        assert _agent_statements() == []
        assert _RecordingConnection.sent, "the batch was written"

        for _ in range(2):  # a differing name: filed once, counted each time, as before
            _RecordingConnection.sent = []
            other = (AgentRecord("r", "a", name="B"),)
            differs = writer.write(Batch((ev("r", "a", 99, key=f"x{_}"),), other))
            assert differs.record_conflicts == 1
            assert _agent_statements()

        # A new agent in the same run is stored as before.
        _RecordingConnection.sent = []
        writer.write(Batch((ev("r", "b", 0),), (AgentRecord("r", "b", name="Bee"),)))
        assert _agent_statements()
    with psycopg.connect(pg_dsn) as conn:
        agents = {a.agent_id: a.name for a in run_agents(conn, "r")}
        row = conn.execute("SELECT count(*) FROM agentcap.record_conflicts").fetchone()
    assert agents == {"a": "A", "b": "Bee"}
    assert row is not None and row[0] == 1


def test_settled_agent_rows_forget_runs_that_are_gone_and_stay_bounded() -> None:
    """Rows of a run the log no longer takes are forgotten; a batch whose records differed from
    the stored rows leaves nothing settled; past the capacity the rows start over."""
    from otel_agentcap.exporters.postgres.writer import SettledAgentRows, _Opened

    def opened(rows: list[Any], gone: tuple[str, ...] = ()) -> _Opened:
        return _Opened({}, [], 0, [], list(gone), 0, rows)

    a1 = ("r1", "a", "A", None, None, False)
    a2 = ("r2", "a", "A", None, None, False)
    settled = SettledAgentRows(capacity=3)
    settled.update(opened([a1, a2]), conflicts=0)
    assert a1 in settled and a2 in settled
    settled.update(opened([], gone=["r1"]), conflicts=0)
    assert a1 not in settled and a2 in settled
    a3 = ("r2", "b", "B", None, None, False)
    settled.update(opened([a3]), conflicts=1)
    assert a3 not in settled
    settled.update(opened([a3, a1, ("r3", "c", None, None, None, False)]), conflicts=0)
    assert a3 in settled and a2 not in settled  # over capacity: started over


@pytest.mark.fault
def test_a_connection_lost_inside_a_pipeline_logs_no_psycopg_warnings(
    pool: ConnectionPool[Any], pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The backend killed while the writer is still sending a statement of its pipeline (the
    barrier waits for a lock, the next statement is larger than the socket's buffers): the
    writer raises ConnectionFailed, and neither psycopg's 'error ignored terminating <Pipeline>:
    the connection is lost' nor the pool's 'discarding closed connection', about the same lost
    connection, reaches the log (they went to the user's stderr where logging was not
    configured)."""
    caplog.set_level("WARNING")
    big = "x" * 8_000_000
    batch = Batch((ev("r", "a", 1),), runs=(RunRecord("r", T0, {"big": big}),))
    writer = EventWriter(pool, max_attempts=1)
    outcome: dict[str, BaseException] = {}

    def write() -> None:
        try:
            writer.write(batch)
        except BaseException as exc:
            outcome["error"] = exc

    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (writer_module.RETENTION_BARRIER_KEY,))
        thread = threading.Thread(target=write)
        thread.start()
        waiting = None
        while waiting is None:
            waiting = holder.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).fetchone()
        holder.execute("SELECT pg_terminate_backend(%s)", waiting)
        thread.join(60)
    assert isinstance(outcome.get("error"), ConnectionFailed), outcome
    psycopgs = [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "psycopg"]
    assert psycopgs == []
