"""Plans of the log's hot queries on a seeded log of many runs in several partitions: each reads
only the partition of its run, through an index bounded by the run, never a sequential scan."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from pg_log import (
    INDEX_SCANS,
    assert_classification_probes_by_key,
    assert_routed,
    coordinate,
    explain,
    log_scans,
    partition_of,
    plan_nodes,
    run_batch,
    write_runs,
)
from psycopg import sql
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres import ledger, memory, partitions, recovery, sequences, store
from otel_agentcap.exporters.postgres.embedded import dsn_for
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.rows import copy_data, prepare
from otel_agentcap.exporters.postgres.writer import EventWriter, start_bounds

pytestmark = pytest.mark.storage

T0 = datetime(2025, 1, 1, tzinfo=UTC)
RUNS = 240  # 80 per month, about 12,000 events in three partitions
RUN = "run-0130"  # in the middle partition


def _start(i: int) -> datetime:
    return T0 + timedelta(hours=9 * i)


@pytest.fixture(scope="module")
def seeded(pg_server_dsn: str) -> Iterator[str]:
    """One migrated database holding RUNS runs, analyzed, shared by the tests of this module."""
    name = f"agentcap_plans_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = dsn_for(pg_server_dsn, name)
    try:
        migrate(dsn)
        write_runs(dsn, ((f"run-{i:04d}", _start(i)) for i in range(RUNS)))
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(RUNS):  # the tool ledger, spawns and memory of every run
                for n in range(3):
                    coordinate(conn, f"run-{i:04d}", _start(i) + timedelta(hours=1), n=n)
            conn.execute("ANALYZE")
        yield dsn
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture()
def conn(seeded: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(seeded) as c:
        yield c
        c.rollback()


def _target(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Parameters naming RUN and the final model call of its planner (many parents, deep past)."""
    events = store.run_events(conn, RUN)
    last_call = max(
        (e for e in events if e.agent_id == "planner" and e.event_type == "model_call"),
        key=lambda e: e.seq,
    )
    return {"run": RUN, "start": store.run_start(conn, RUN), "event": uuid.UUID(last_call.event_id)}


def test_the_seeded_log_spans_several_partitions(conn):
    """The fixture's runs fill three partitions, so routing to one of them can be told apart."""
    rows = conn.execute(
        "SELECT count(DISTINCT tableoid) FROM agentcap.events WHERE run_started_at < '2026-01-01'"
    ).fetchone()
    assert rows == (3,)


@pytest.mark.parametrize(
    "query",
    ["_EVENTS", "_EVENT", "_PARENTS", "_CHILDREN", "_PAST"],
)
def test_run_and_event_queries_read_one_partition_by_index(conn, query):
    """show, an event, its parents, its children and its causal past read only the run's
    partition, through indexes bounded by the run (or one event id)."""
    params = _target(conn)
    partition = partition_of(conn, RUN)
    plan = explain(conn, getattr(store, query), params, analyze=True)
    assert_routed(conn, plan, {partition}, executed_only=True)
    # Planned with the run's start known: no other partition is in the plan at all.
    planned = explain(conn, getattr(store, query), params, analyze=False)
    assert_routed(conn, planned, {partition}, executed_only=False)


def test_causal_queries_answer_what_the_seed_wrote(conn):
    """The planner's final call has the workers' ends as parents, and its causal past holds every
    event of the run but the planner's last (its own end) and the memory writes the seed added."""
    params = _target(conn)
    run_id, event_id = params["run"], str(params["event"])
    parents = store.event_parents(conn, run_id, event_id)
    assert {(e.agent_id, e.event_type) for e in parents} == {
        (f"planner/w{w}", "agent_end") for w in range(3)
    }
    events = store.run_events(conn, run_id)
    past = store.causal_past(conn, run_id, event_id)
    later = {e.event_id for e in events if e.agent_id == "planner" and e.event_type == "agent_end"}
    later |= {e.event_id for e in events if e.agent_id == "coordinator"}  # memory, unrelated
    assert {e.event_id for e in past} == {e.event_id for e in events} - later - {event_id}
    end = parents[0]
    assert [e.event_id for e in store.event_children(conn, run_id, end.event_id)] == [event_id]


def test_run_list_reads_one_partition_per_listed_run(conn):
    """The run list counts each listed run's events in its own partition only: one index probe
    per run, whatever the number of runs and partitions."""
    plan = explain(conn, store._LIST_RUNS, (25,), analyze=True)
    listed = store.list_runs(conn, limit=25)
    partitions = {partition_of(conn, r.run_id) for r in listed}
    scans = assert_routed(conn, plan, partitions, executed_only=True)
    assert sum(node["Actual Loops"] for node in scans) == len(listed) == 25


def test_sequence_reservation_reads_one_partition(conn):
    """Reserving a sequence block looks for the agent's stored events in its run's partition."""
    params = {"run": RUN, "agent": "planner/w1", "at_least": 0, "size": 10}
    plan = explain(conn, sequences._RESERVE, params, analyze=True)
    conn.rollback()
    scans = assert_routed(conn, plan, {partition_of(conn, RUN)}, executed_only=True)
    assert len(scans) == 1


def test_spawn_lookup_reads_one_partition(conn):
    """A spawn retried in a new process finds its spawn event in the run's partition only."""
    plan = explain(conn, recovery._FIND, {"run": RUN, "agent": "planner/w1"}, analyze=True)
    assert_routed(conn, plan, {partition_of(conn, RUN)}, executed_only=True)


_COORDINATION = {
    "memory read": (memory._READ, (RUN, "notes", "k1")),
    "memory keys": (memory._KEYS, (RUN, "notes")),
    "ledger completion": (
        ledger._COMPLETE,
        ("succeeded", None, None, None, None, None, None, RUN, "coordinator", "inv-1", "x", "o", 1),
    ),
    "registered spawn": (recovery._FIND_REGISTERED, {"run": RUN, "child": "coordinator/c1"}),
    "ledger claim read back": (ledger._MY_CLAIM, (RUN, "coordinator", "inv-1", "x", "o/1")),
}


@pytest.mark.parametrize("name", sorted(_COORDINATION))
def test_coordination_queries_read_their_run_by_key(conn, name):
    """The capture path's own queries (memory, tool ledger, spawn registry) read their tables by
    the primary key that leads with run_id, whatever the number of other runs."""
    query, params = _COORDINATION[name]
    plan = explain(conn, query, params, analyze=True)
    conn.rollback()
    tables = {"tool_ledger", "spawns", "memory"}
    reads = [
        n
        for n in plan_nodes(plan)
        if n.get("Relation Name") in tables and n["Node Type"] != "ModifyTable"
    ]
    assert reads, plan
    for node in reads:
        assert node["Node Type"] in INDEX_SCANS, node
        assert node["Index Name"].endswith("_pkey") and "run_id" in node["Index Cond"], node


def test_writer_probes_read_one_partition(seeded, conn):
    """The writer's classification of a re-sent run probes every key in that run's partition,
    and only that partition is planned."""
    batch = prepare(run_batch(RUN, _start(130)))
    start = store.run_start(conn, RUN)
    conn.rollback()
    with ConnectionPool(seeded, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        with pool.connection() as wconn:
            writer._ensure_staging(wconn)
            with wconn.transaction(force_rollback=True):
                wconn.execute(sql.SQL("TRUNCATE {}").format(writer._staging))
                with wconn.cursor() as cur, cur.copy(writer._copy) as copy:
                    copy.write(copy_data(batch.events, staging=True, starts={RUN: start}))
                wconn.execute(sql.SQL("ANALYZE {}").format(writer._staging))
                bounds = start_bounds([start])
                plan = explain(wconn, writer._classify_full, bounds, analyze=True)
                scans = assert_routed(wconn, plan, {partition_of(wconn, RUN)}, executed_only=True)
                # Planned with the batch's starts known: no other partition is in the plan (each
                # probe of every partition was planned, and planning grew with the partitions).
                planned = explain(wconn, writer._classify_full, bounds, analyze=False)
                assert_routed(wconn, planned, {partition_of(wconn, RUN)}, executed_only=False)
        writer.close()
    assert sum(node["Actual Loops"] for node in scans) >= len(batch.events)


def _one_event_per_step(scans: list[Any]) -> None:
    for node in scans:
        if node["Actual Loops"] > 1:  # a step repeated per event, not the final read of the run
            # Both figures are averages per loop.
            read = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            assert read <= 2, node


@pytest.mark.parametrize("query", ["_PARENTS", "_PAST"])
def test_causal_steps_read_one_event_each(conn, query):
    """Each step of the parents and causal-past queries reads one event by its key (or the one
    before it in its agent), never the whole run."""
    params = _target(conn)
    plan = explain(conn, getattr(store, query), params, analyze=True)
    _one_event_per_step(assert_routed(conn, plan, {partition_of(conn, RUN)}, executed_only=True))


@pytest.mark.parametrize("query", ["_EVENTS", "_PARENTS", "_CHILDREN", "_PAST"])
def test_queries_read_only_the_run_before_any_analyze(pg_dsn, query):
    """Before autovacuum has analyzed a new partition, the planner's guesses may read a whole run
    where one event would do, but still only the run's partition, by an index bounded by it.
    (Six runs of 121 events: below the 1,000 rows after which a writer has it analyzed.)"""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        partitions.ensure_partitions(conn, [T0])
        conn.execute("ALTER TABLE agentcap.events_p20250101 SET (autovacuum_enabled = false)")
        write_runs(pg_dsn, [(f"r-{i}", T0 + timedelta(hours=i)) for i in range(6)], steps=12)
        analyzed = conn.execute(
            "SELECT count(*) FROM pg_stats WHERE schemaname = 'agentcap'"
            " AND tablename LIKE 'events%%'"
        ).fetchone()
        assert analyzed == (0,), "a partition was analyzed: the test needs it not to be"
        run = "r-4"
        events = store.run_events(conn, run)
        last = max((e for e in events if e.agent_id == "planner"), key=lambda e: e.seq)
        params = {
            "run": run,
            "start": store.run_start(conn, run),
            "event": uuid.UUID(last.event_id),
        }
        plan = explain(conn, getattr(store, query), params, analyze=True)
        assert_routed(conn, plan, {partition_of(conn, run)}, executed_only=True)


def _view_query(name: str, start: datetime) -> tuple[Any, Any]:
    queries = {
        "graph": (store._GRAPH, (RUN, start)),
        "labels": (store._LABELS, (RUN, start, 0, 5, None, None)),
        "detail": (store._DETAIL, (RUN, start, "planner/w1", 3)),
        "version": (store._VERSION, {"run": RUN, "start": start}),
        "texts": (store._EVENT_TEXTS, (RUN, start)),
    }
    if name == "labels of two agents":
        agents = ["planner", "planner/w1"]
        return store._LABELS, (RUN, start, 0, 5, agents, agents)
    return queries[name]


@pytest.mark.parametrize(
    "name", ["graph", "labels", "labels of two agents", "detail", "version", "texts"]
)
def test_web_view_queries_read_one_partition_by_index(conn, name):
    """The web view's run graph, label windows, event detail, change check and export read only
    the run's partition, by index."""
    query, params = _view_query(name, store.run_start(conn, RUN))
    events = {partition_of(conn, RUN)}
    conflicts = {partition_of(conn, RUN, "conflicts")}
    plan = explain(conn, query, params, analyze=True)
    scans = log_scans(conn, plan, executed_only=True)
    # Conflicts partitions are tiny here, where a sequential scan is the right plan: only their
    # routing is checked.
    event_scans = [n for n in scans if n["Relation Name"] not in conflicts]
    assert {n["Relation Name"] for n in scans} <= events | conflicts
    assert event_scans and all(n["Node Type"] != "Seq Scan" for n in event_scans), event_scans


@pytest.mark.parametrize("within", [None, ([RUN], ["run-01"])])
def test_web_view_run_list_reads_one_partition_per_listed_run(conn, within):
    """The web view's page of runs with totals reads each listed run's partition only, once, also
    for a token scoped to some runs."""
    ids, prefixes = within if within is not None else ([], [])
    params = {
        "q": None,
        "limit": 25,
        "offset": 0,
        "within": within is not None,
        "ids": ids,
        "prefixes": prefixes,
    }
    plan = explain(conn, store._RUN_TOTALS_PAGE, params, analyze=True)
    listed = store.run_totals(conn, limit=25, within=within)
    assert len(listed) == 25
    events = {partition_of(conn, r.run_id) for r in listed}
    conflicts = {partition_of(conn, r.run_id, "conflicts") for r in listed}
    scans = log_scans(conn, plan, executed_only=True)
    assert {n["Relation Name"] for n in scans} <= events | conflicts
    event_scans = [n for n in scans if n["Relation Name"] in events]
    assert all(n["Node Type"] in INDEX_SCANS | {"Bitmap Heap Scan"} for n in event_scans)
    assert (
        sum(n["Actual Loops"] for n in event_scans if n["Node Type"] != "Bitmap Index Scan") == 25
    )


@pytest.mark.parametrize("query", ["_SPANS", "_EVENTS", "_CONFLICTS"])
def test_export_reads_one_partition_of_each_table(conn, query):
    """otel-agentcap export reads the run's spans, events and conflicts in the run's partition
    of each table (events by index; the small spans and conflicts partitions may be scanned)."""
    from otel_agentcap.transfer import snapshot

    start = store.run_start(conn, RUN)
    plan = explain(conn, getattr(snapshot, query), (RUN, start), analyze=True)
    tables = {partition_of(conn, RUN, t) for t in ("events", "spans", "conflicts")}
    scans = log_scans(conn, plan, executed_only=False)
    assert scans and {n["Relation Name"] for n in scans} <= tables
    events = partition_of(conn, RUN)
    assert all(n["Node Type"] != "Seq Scan" for n in scans if n["Relation Name"] == events)


def test_a_writer_filling_a_new_partition_keeps_probing_by_key(pg_dsn):
    """One run of 12,000 events written in batches into a partition no analyze has seen yet:
    the writer has the partition analyzed as it fills it, so the classification of the next
    batch probes each row by the primary key, reading one event, not the whole run."""
    from otel_agentcap.model import Batch, Event, RunRecord, event_id_for

    start = datetime(2025, 2, 3, tzinfo=UTC)

    def batch(first: int, size: int = 2_000) -> Batch:
        events = tuple(
            Event(
                event_id_for("big", f"a{i % 8}", f"seq:{i // 8}"),
                "big",
                f"a{i % 8}",
                i // 8,
                "model_call",
                f"seq:{i // 8}",
                start + timedelta(milliseconds=i),
                payload={"note": "x" * 300},
            )
            for i in range(first, first + size)
        )
        return Batch(events, runs=(RunRecord("big", start),))

    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        for first in range(0, 12_000, 2_000):
            assert writer.write(batch(first)).inserted == 2_000
        assert_classification_probes_by_key(writer, batch(12_000), "big", start)
        writer.close()


class _Recording:
    """A connection that records every statement sent through it (and through its cursors), to
    be explained afterwards; entering and leaving it neither commits nor closes."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.statements: list[tuple[Any, Any]] = []

    def __enter__(self) -> _Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        self.statements.append((query, params))
        return self.conn.execute(query, params, **kwargs)

    def cursor(self, *args: Any, **kwargs: Any) -> _RecordingCursor:
        return _RecordingCursor(self, self.conn.cursor(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


class _RecordingCursor:
    def __init__(self, owner: _Recording, cursor: Any) -> None:
        self.owner = owner
        self.cursor = cursor

    def __enter__(self) -> _RecordingCursor:
        self.cursor.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.cursor.__exit__(*exc)

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> _RecordingCursor:
        self.owner.statements.append((query, params))
        self.cursor.execute(query, params, **kwargs)
        return self

    def __iter__(self) -> Iterator[Any]:
        return iter(self.cursor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cursor, name)


@pytest.mark.parametrize("command", ["show", "show --json", "event --past"])
def test_every_statement_of_show_and_event_reads_only_the_runs_partitions(
    conn, monkeypatch, capsys, command
):
    """Every statement that ``otel-agentcap show`` and ``event`` send about a run reads the log
    only in the run's partitions, by index, planned with the run's start known: also show's
    conflict counts per agent and its lookup of a causal parent the run's events do not hold."""
    from otel_agentcap.cli import commands

    params = _target(conn)
    # An event of RUN whose parent is not among the run's events (rolled back with the test).
    conn.execute(
        "INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time,"
        " event_type, causal_parent_ids, idempotency_key, payload, run_started_at)"
        " VALUES (gen_random_uuid(), %(run)s, 'planner', 9999, %(start)s, 'agent_end',"
        " ARRAY[gen_random_uuid()], 'seq:9999', '{}', %(start)s)",
        params,
    )
    recording = _Recording(conn)
    monkeypatch.setattr(commands, "_connect", lambda dsn, lock_timeout=None: recording)
    name, *flags = command.split()
    argv = [name, RUN, *([str(params["event"])] if name == "event" else []), *flags]
    args = commands.build_parser().parse_args([*argv, "--dsn", "unused"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    if command == "show":
        assert "(not stored)" in out  # the parent was looked up, and is not in the log
    owned = {partition_of(conn, RUN, table) for table in ("events", "conflicts", "spans")}
    events = partition_of(conn, RUN)
    read = 0
    for query, query_params in recording.statements:
        plan = explain(conn, query, query_params, analyze=False)
        scans = log_scans(conn, plan, executed_only=False)
        if not scans:
            continue  # runs, agents: keyed by run_id, not partitioned
        # Only the run's partitions are planned at all; the events partition is read by index
        # bounded by the run (or a GIN lookup of one event id, as assert_routed allows); the
        # seed's empty conflicts partition may be scanned.
        assert {n["Relation Name"] for n in scans} <= owned, (query, scans)
        for node in scans:
            if node["Relation Name"] == events and node["Node Type"] != "Bitmap Heap Scan":
                assert node["Node Type"] in INDEX_SCANS, node
                cond = node["Index Cond"]
                assert "run_id" in cond or "causal_parent_ids @>" in cond, node
        read += 1
    assert read >= (3 if name == "show" else 4), recording.statements


def test_locate_events_finds_stored_and_moved_parents_of_the_run(conn):
    """show's lookup of parent ids the run's events do not hold finds, in the run, a stored
    event by its id and a record kept in conflicts as the event it collided with; an unknown id
    and an id of another run's event are left out (a parent names an event of its own run)."""
    events = store.run_events(conn, RUN)
    stored, collided = events[3], events[5]
    moved = str(uuid.uuid4())
    conn.execute(
        "INSERT INTO agentcap.conflicts (reason, existing_event_id, row_digest, event_id, run_id,"
        " agent_id, logical_seq, wall_time, event_type, causal_parent_ids, idempotency_key,"
        " payload, run_started_at)"
        " SELECT 'model_call_response_id', event_id, 'digest', %s, run_id, agent_id, logical_seq,"
        " wall_time, event_type, causal_parent_ids, idempotency_key, payload, run_started_at"
        " FROM agentcap.events WHERE run_id = %s AND event_id = %s",
        (moved, RUN, collided.event_id),
    )
    other = store.run_events(conn, "run-0001")[0]
    found = store.locate_events(
        conn, RUN, [stored.event_id, moved, str(uuid.uuid4()), other.event_id]
    )
    assert found == {
        stored.event_id: (stored.agent_id, stored.seq),
        moved: (collided.agent_id, collided.seq),
    }
    assert store.locate_events(conn, RUN, []) == {}
    assert store.locate_events(conn, "no-such-run", [stored.event_id]) == {}


def test_a_writer_filling_a_new_partition_with_small_runs_has_it_analyzed(pg_dsn):
    """Runs of 100 events each, written into a partition no analyze has seen: the writer counts
    the rows per partition, not per run, so it has the partition analyzed once it holds 1,000
    rows (counted per run, no run ever reached 1,000 and only autovacuum could analyze it)."""
    from otel_agentcap.model import Batch, Event, RunRecord, event_id_for

    start = datetime(2025, 3, 3, tzinfo=UTC)

    def run(n: int) -> Batch:
        run_id = f"small-{n:03d}"
        at = start + timedelta(minutes=n)
        events = tuple(
            Event(
                event_id_for(run_id, "a", f"seq:{i}"),
                run_id,
                "a",
                i,
                "model_call",
                f"seq:{i}",
                at + timedelta(milliseconds=i),
                payload={"note": "x" * 400},
            )
            for i in range(100)
        )
        return Batch(events, runs=(RunRecord(run_id, at),))

    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        for n in range(0, 30, 5):
            batches = [run(k) for k in range(n, n + 5)]
            batch = Batch(
                tuple(e for b in batches for e in b.events),
                runs=tuple(r for b in batches for r in b.runs),
            )
            assert writer.write(batch).inserted == 500
        writer.close()
    with psycopg.connect(pg_dsn) as conn:
        partition = partition_of(conn, "small-000")
        row = conn.execute(
            "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = %s", (partition,)
        ).fetchone()
    assert row is not None and row[0] >= 1, (partition, row)
