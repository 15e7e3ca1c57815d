"""Storage test helpers: runs of a realistic shape (a planner that spawns workers, workers that call
a model and run tools, causal parents across agents), and the reading of query plans."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres.rows import copy_data, prepare
from otel_agentcap.exporters.postgres.writer import EventWriter, start_bounds
from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, SpanRecord, event_id_for


def run_batch(
    run_id: str, started: datetime, *, workers: int = 3, steps: int = 4, seed: int = 0
) -> Batch:
    """One run as one batch: about ``4 + workers * (3 + 3 * steps)`` events, each on its agent's
    span, and the envelopes of those spans and of the run's root span, in one trace."""
    rng = random.Random(f"{run_id}/{seed}")
    events: list[Event] = []
    agents: list[AgentRecord] = [AgentRecord(run_id, "planner", name="planner", lineage_known=True)]
    clock = [started]
    trace = hashlib.md5(run_id.encode()).hexdigest()

    def span_of(agent: str) -> str:
        return hashlib.md5(f"{run_id}/{agent}".encode()).hexdigest()[:16]

    def add(agent: str, seq: int, kind: str, key: str, parents: tuple[str, ...] = ()) -> str:
        clock[0] += timedelta(milliseconds=rng.randint(1, 400))
        event_id = event_id_for(run_id, agent, key)
        payload: dict[str, object] = {"note": f"{kind} {key} " + "x" * rng.randint(50, 400)}
        if kind == "model_call":
            payload["response_id"] = f"msg_{run_id}_{agent}_{seq}"
            payload["usage"] = {"input_tokens": rng.randint(10, 2000), "output_tokens": 42}
        events.append(
            Event(
                event_id,
                run_id,
                agent,
                seq,
                kind,
                key,
                clock[0],
                parents,
                payload,
                trace,
                span_of(agent),
            )
        )
        return event_id

    add("planner", 0, "agent_start", "seq:0")
    plan = add("planner", 1, "model_call", "seq:1")
    ends = []
    planner_seq = 2
    for w in range(workers):
        child = f"planner/w{w}"
        spawn = add("planner", planner_seq, "agent_spawn", f"spawn:{child}", (plan,))
        planner_seq += 1
        agents.append(
            AgentRecord(
                run_id,
                child,
                name="worker",
                parent_agent_id="planner",
                spawned_at_event_id=spawn,
                lineage_known=True,
            )
        )
        seq = 0
        last = add(child, seq, "agent_start", f"seq:{seq}", (spawn,))
        for step in range(steps):
            seq += 1
            call = add(child, seq, "model_call", f"seq:{seq}", (last,))
            seq += 1
            add(child, seq, "tool_invocation", f"tool:t{step}:invocation", (call,))
            seq += 1
            last = add(child, seq, "tool_result", f"tool:t{step}:result", (call,))
        seq += 1
        ends.append(add(child, seq, "agent_end", f"seq:{seq}", (last,)))
    add("planner", planner_seq, "model_call", f"seq:{planner_seq}", tuple(ends))
    add("planner", planner_seq + 1, "agent_end", f"seq:{planner_seq + 1}")
    root = span_of("")
    spans = [
        SpanRecord(run_id, trace, root, None, f"invoke_workflow {run_id}", 0, started, clock[0])
    ]
    for agent in agents:
        times = [e.wall_time for e in events if e.agent_id == agent.agent_id]
        spans.append(
            SpanRecord(
                run_id,
                trace,
                span_of(agent.agent_id),
                root,
                f"invoke_agent {agent.agent_id}",
                0,
                min(times),
                max(times),
            )
        )
    return Batch(
        tuple(events),
        tuple(agents),
        (RunRecord(run_id, started, {"seed": seed}, trace, root),),
        spans=tuple(spans),
    )


def write_runs(
    dsn: str, starts: Iterable[tuple[str, datetime]], *, workers: int = 3, steps: int = 4
) -> int:
    """Write one ``run_batch`` per (run id, start) through the real writer; events inserted."""
    inserted = 0
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        for run_id, started in starts:
            inserted += writer.write(
                run_batch(run_id, started, workers=workers, steps=steps)
            ).inserted
        writer.close()
    return inserted


# --- the coordination tables (migration 0005) --------------------------------------------------

#: The tables processes of a run write on the capture path, outside the exporter.
COORDINATION_TABLES: Final = ("tool_ledger", "spawns", "memory")


def coordinate(conn: psycopg.Connection[Any], run_id: str, at: datetime, *, n: int = 0) -> None:
    """What the capture path of a process of ``run_id`` writes on its own, through the same SQL
    functions: a tool claim, a spawn registration and a memory write (with its memory_write event
    at sequence ``1000 + n`` of agent ``coordinator``), one per call (``n`` tells calls apart)."""
    conn.execute(
        "SELECT * FROM agentcap.tool_claim(%s, 'coordinator', %s, %s, 'search', 'pid-1', 30, false)",
        (run_id, f"inv-{n}", hashlib.sha256(f"{run_id}/{n}".encode()).hexdigest()),
    )
    child = f"coordinator/c{n}"
    conn.execute(
        "SELECT * FROM agentcap.spawn_register(%s, %s, 'coordinator', 'c', NULL, %s, %s, NULL, NULL)",
        (run_id, child, event_id_for(run_id, "coordinator", f"spawn:{child}"), 2000 + n),
    )
    conn.execute(
        "SELECT * FROM agentcap.memory_write(%s, 'notes', %s, 'set', true, %s::jsonb, NULL,"
        " 'coordinator', %s, %s, %s, NULL, NULL, NULL)",
        (
            run_id,
            f"k{n}",
            f'{{"n": {n}}}',
            event_id_for(run_id, "coordinator", f"seq:{1000 + n}"),
            1000 + n,
            at,
        ),
    )


def per_run_tables(conn: psycopg.Connection[Any]) -> list[str]:
    """Every table of the schema with a run_id column (partitions counted through their parent;
    a writer's staging tables are its own)."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid"
        " WHERE c.relnamespace = 'agentcap'::regnamespace AND c.relkind IN ('r', 'p')"
        " AND NOT c.relispartition AND a.attname = 'run_id' AND NOT a.attisdropped"
        " AND c.relname NOT IN ('runs', 'pruned_runs') AND c.relname NOT LIKE 'staging\\_%'"
        " ORDER BY 1"
    ).fetchall()
    return [str(r[0]) for r in rows]


def orphans(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Rows of every per-run table whose run has no runs row, and rows of the run-partitioned
    tables that sit in another partition than their run's start; all zero in a sound log."""
    counts = {}
    for table in per_run_tables(conn):
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM agentcap.{} x"
                " WHERE NOT EXISTS (SELECT 1 FROM agentcap.runs r WHERE r.run_id = x.run_id)"
            ).format(sql.Identifier(table))
        ).fetchone()
        counts[table] = int(row[0]) if row else -1
    for (table,) in conn.execute(
        "SELECT c.relname FROM agentcap.run_partitioned_tables() t JOIN pg_class c ON c.oid = t"
    ).fetchall():
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM agentcap.{} x JOIN agentcap.runs r USING (run_id)"
                " WHERE x.run_started_at <> r.started_at"
            ).format(sql.Identifier(str(table)))
        ).fetchone()
        counts[f"{table} in the wrong partition"] = int(row[0]) if row else -1
    return counts


def rows_of_runs(conn: psycopg.Connection[Any], run_ids: Iterable[str]) -> dict[str, int]:
    """Rows per per-run table (runs included) that belong to ``run_ids``."""
    ids = list(run_ids)
    counts = {}
    for table in [*per_run_tables(conn), "runs"]:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM agentcap.{} WHERE run_id = ANY(%s)").format(
                sql.Identifier(table)
            ),
            (ids,),
        ).fetchone()
        counts[table] = int(row[0]) if row else -1
    return counts


# --- query plans --------------------------------------------------------------------------------

#: The scans that read a bounded part of an index (a Bitmap Heap Scan is judged by its children).
INDEX_SCANS: Final = frozenset({"Index Scan", "Index Only Scan", "Bitmap Index Scan"})


def explain(conn: psycopg.Connection[Any], query: Any, params: Any = None, *, analyze: bool) -> Any:
    """The JSON plan of ``query``; with ``analyze`` it is executed (roll back writes yourself)."""
    options = "ANALYZE, FORMAT JSON" if analyze else "FORMAT JSON"
    prefix = sql.SQL(f"EXPLAIN ({options}) ")
    statement = prefix + (
        query
        if isinstance(query, sql.Composable)
        else sql.SQL(query.decode() if isinstance(query, bytes) else query)
    )
    row = conn.execute(statement, params).fetchone()
    assert row is not None
    return row[0][0]["Plan"]


def plan_nodes(plan: Any) -> Iterator[Any]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from plan_nodes(child)


def log_partitions(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Partition name -> parent name, for every run-partitioned table."""
    rows = conn.execute(
        "SELECT c.relname, p.relname FROM pg_inherits i"
        " JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent"
        " WHERE p.oid IN (SELECT agentcap.run_partitioned_tables())"
    ).fetchall()
    return {str(child): str(parent) for child, parent in rows}


def partition_of(conn: psycopg.Connection[Any], run_id: str, table: str = "events") -> str:
    row = conn.execute(
        "SELECT p.partition::text FROM agentcap.runs r,"
        " agentcap.log_partitions(%s::regclass) p"
        " WHERE r.run_id = %s AND p.lower <= r.started_at AND r.started_at < p.upper",
        (f"agentcap.{table}", run_id),
    ).fetchone()
    assert row is not None, run_id
    return str(row[0]).split(".")[-1]


def log_scans(conn: psycopg.Connection[Any], plan: Any, *, executed_only: bool) -> list[Any]:
    """The scan nodes of ``plan`` that read a partition of the log (with their index scans
    under a bitmap heap scan), executed ones only when asked (EXPLAIN ANALYZE)."""
    parts = log_partitions(conn)
    index_parts = {
        str(name): str(table)
        for name, table in conn.execute(
            "SELECT i.relname, c.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid"
            " JOIN pg_class c ON c.oid = x.indrelid"
            " WHERE c.relname = ANY(%s)",
            (list(parts),),
        )
    }
    found = []
    for node in plan_nodes(plan):
        relation = node.get("Relation Name") or index_parts.get(node.get("Index Name", ""))
        if relation not in parts:
            continue
        if executed_only and node.get("Actual Loops", 0) == 0:
            continue
        found.append({**node, "Relation Name": relation})
    return found


def assert_routed(
    conn: psycopg.Connection[Any], plan: Any, partitions: set[str], *, executed_only: bool
) -> list[Any]:
    """Every read of the log in ``plan`` is an index scan of one of ``partitions`` bounded by the
    run (or a GIN lookup of one event id), never a sequential scan; returns the scans."""
    scans = log_scans(conn, plan, executed_only=executed_only)
    assert scans, "the plan reads no partition of the log"
    for node in scans:
        kind = node["Node Type"]
        assert node["Relation Name"] in partitions, (node["Relation Name"], partitions)
        assert kind != "Seq Scan", node
        if kind == "Bitmap Heap Scan":
            continue  # judged by its Bitmap Index Scan, collected too
        assert kind in INDEX_SCANS, node
        cond = node.get("Index Cond", "")
        assert "run_id" in cond or "causal_parent_ids @>" in cond, node
    return scans


def assert_classification_probes_by_key(
    writer: EventWriter, batch: Batch, run_id: str, start: datetime
) -> None:
    """Stage ``batch`` (of run ``run_id``, started at ``start``) as ``writer`` would, explain its
    classifying statement executed, and check that it reads only the run's partition and that
    each probe reads at most one event by the primary key (not the whole run). Rolled back."""
    prepared = prepare(batch)
    with writer._pool.connection() as conn, conn.transaction(force_rollback=True):
        conn.execute(sql.SQL("TRUNCATE {}").format(writer._staging))
        with conn.cursor() as cur, cur.copy(writer._copy) as copy:
            copy.write(copy_data(prepared.events, staging=True, starts={run_id: start}))
        plan = explain(conn, writer._classify_fast, start_bounds([start]), analyze=True)
        scans = assert_routed(conn, plan, {partition_of(conn, run_id)}, executed_only=True)
    probes = [n for n in scans if n["Actual Loops"] >= len(prepared.events)]
    assert probes, scans
    for node in probes:
        assert node["Index Name"].endswith("_pkey"), node
        assert node["Actual Rows"] + node.get("Rows Removed by Filter", 0) <= 1, node
