"""The log at scale: grow it to 1 and 10 million events through the real writer and report, in one
run, insert throughput at the start and at the end, the time of show and causal-past queries of
the same runs at each size, disk bytes per event, and prune time per partition.

Runs an embedded PostgreSQL 18 in a temporary directory (deleted afterwards unless ``--keep``),
or uses ``--dsn`` (a database it may fill and drop tables in). Runs have a realistic shape: a
planner that spawns 1 to 6 workers, each calling a model and running tools 2 to 20 times (about
20 to 400 events, 150 on average), with causal parents across agents, response and request ids
on model calls, and payloads of 100 to 1,500 bytes. Run starts advance through time (one week
of runs per 500,000 events by default, weekly partitions), so the log spans many partitions as
a long-lived deployment's does. Batches of ``--batch`` events, several runs each.

    .venv/bin/python bench/bench_pg_scale.py [--sizes 1000000 10000000] [--batch 2000]
        [--window 250000] [--interval '7 days'] [--events-per-week 500000] [--dsn DSN] [--keep]

The machine's speed varies with other work, so the same 20,000 events are also written, again
and again, into an empty log in another database of the same server, one batch of them after
every few batches of the growing log, one whole cycle per window of ``--window`` events: the
window's rate divided by that baseline's rate, measured over the same minutes, is the figure
compared between the start and the end (medians of the first and of the last four windows, with
their spread; a single window is a few seconds of a shared machine). Each window also says what
the server did meanwhile: blocks read from outside shared buffers and hit per event, WAL bytes
per event, checkpoints, vacuums and analyzes of the log's tables.

Queries are timed on a connection of their own: the first call (its pages may have left shared
buffers since the run was written) apart from the warm calls after it (median, 10th and 90th
percentiles), and EXPLAIN ANALYZE gives the server's planning and execution time apart, and the
shared buffers hit and read.

Targets: insert throughput at the end at least 0.8 of the start; show and causal-past times
flat (within noise) from 1 to 10 million events. Not a test: it takes tens
of minutes.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres import embedded, partitions, retention, store
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, SpanRecord, event_id_for

T0 = datetime(2025, 1, 6, tzinfo=UTC)  # a Monday
WORDS = [
    "the",
    "tool",
    "returned",
    "three",
    "documents",
    "and",
    "the",
    "second",
    "one",
    "answers",
    "the",
    "question",
    "about",
    "latency",
    "budgets",
    "while",
    "the",
    "first",
    "repeats",
    "the",
    "plan",
    "and",
    "the",
    "third",
    "is",
    "unrelated",
    "noise",
]


@dataclass
class Run:
    run_id: str
    started: datetime
    events: list[Event] = field(default_factory=list)
    agents: list[AgentRecord] = field(default_factory=list)
    spans: list[SpanRecord] = field(default_factory=list)


def _text(rng: random.Random, size: int) -> str:
    out: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


def make_run(
    run_id: str, started: datetime, rng: random.Random, *, workers: int, steps: int
) -> Run:
    """One run of the shape described in the module docstring, with the span envelopes the
    exporter stores: the run's root span, one per agent (its start and end events) and one per
    operation (a tool's invocation and result share theirs)."""
    run = Run(
        run_id, started, agents=[AgentRecord(run_id, "planner", name="planner", lineage_known=True)]
    )
    clock = [started]
    trace = f"{rng.getrandbits(128):032x}"
    root = f"{rng.getrandbits(64):016x}"
    agent_spans: dict[str, str] = {}
    open_tools: dict[str, str] = {}

    def span_for(agent: str, kind: str, key: str) -> str:
        if kind in ("agent_start", "agent_end", "agent_error"):
            if agent not in agent_spans:
                agent_spans[agent] = f"{rng.getrandbits(64):016x}"
                run.spans.append(
                    SpanRecord(
                        run_id,
                        trace,
                        agent_spans[agent],
                        root,
                        f"invoke_agent {agent}",
                        0,
                        clock[0],
                        clock[0],
                    )
                )
            return agent_spans[agent]
        invocation = key.rsplit(":", 1)[0]
        if kind == "tool_result" and invocation in open_tools:
            return open_tools.pop(invocation)
        span = f"{rng.getrandbits(64):016x}"
        run.spans.append(
            SpanRecord(
                run_id,
                trace,
                span,
                agent_spans.get(agent, root),
                kind,
                0,
                clock[0],
                clock[0] + timedelta(milliseconds=rng.randint(50, 5000)),
            )
        )
        if kind == "tool_invocation":
            open_tools[invocation] = span
        return span

    def add(agent: str, seq: int, kind: str, key: str, parents: tuple[str, ...] = ()) -> str:
        clock[0] += timedelta(milliseconds=rng.randint(5, 3000))
        event_id = event_id_for(run_id, agent, key)
        payload: dict[str, Any] = {"text": _text(rng, rng.randint(100, 1500))}
        if kind == "model_call":
            payload.update(
                model="claude-sonnet-4-5",
                response_id=f"msg_{rng.getrandbits(96):024x}",
                request_id=f"req_{rng.getrandbits(96):024x}",
                usage={
                    "input_tokens": rng.randint(100, 20000),
                    "output_tokens": rng.randint(10, 900),
                },
                stop_reason="tool_use",
            )
        elif kind in ("tool_invocation", "tool_result"):
            payload.update(tool="search", invocation_id=key.split(":")[1])
        span = span_for(agent, kind, key)
        run.events.append(
            Event(event_id, run_id, agent, seq, kind, key, clock[0], parents, payload, trace, span)
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
        run.agents.append(
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
            add(child, seq, "tool_invocation", f"tool:{w}-{step}:invocation", (call,))
            seq += 1
            last = add(child, seq, "tool_result", f"tool:{w}-{step}:result", (call,))
        seq += 1
        ends.append(add(child, seq, "agent_end", f"seq:{seq}", (last,)))
    add("planner", planner_seq, "model_call", f"seq:{planner_seq}", tuple(ends))
    add("planner", planner_seq + 1, "agent_end", f"seq:{planner_seq + 1}")
    run.spans.append(
        SpanRecord(run_id, trace, root, None, f"invoke_workflow {run_id}", 0, started, clock[0])
    )
    return run


REFERENCE = {"workers": 4, "steps": 10}  # 136 events: the runs whose queries are timed


class Baseline:
    """The same 20,000 events written into an empty log of another database of the server, one
    batch at a time between the batches of the growing log, so that each window's baseline is
    measured over the same minutes as the window: the server's speed at the moment (other work
    on the machine, checkpoints), to divide the window's rate by."""

    def __init__(self, server_dsn: str, interval: str) -> None:
        self.name = "agentcap_scale_baseline"
        self.server_dsn = server_dsn
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {self.name}")
        self.dsn = embedded.dsn_for(server_dsn, self.name)
        migrate(self.dsn)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            partitions.set_partition_interval(conn, interval)
        rng = random.Random(7)
        runs: list[Run] = []
        self.events = 0
        while self.events < 20_000:
            runs.append(make_run(f"b-{len(runs)}", T0, rng, workers=3, steps=10))
            self.events += len(runs[-1].events)
        self.batches = [
            Batch(
                tuple(e for r in runs[i : i + 20] for e in r.events),
                tuple(a for r in runs[i : i + 20] for a in r.agents),
                spans=tuple(x for r in runs[i : i + 20] for x in r.spans),
            )
            for i in range(0, len(runs), 20)
        ]
        self._next = 0
        self._seconds = 0.0
        self._pool: ConnectionPool[Any] | None = None
        self._writer: EventWriter | None = None

    def _start_cycle(self) -> EventWriter:
        """An empty log and a new writer, as at the start of the first window (not timed)."""
        self._close()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                "TRUNCATE agentcap.events, agentcap.conflicts, agentcap.runs, agentcap.agents,"
                " agentcap.spans"
            )
        self._pool = ConnectionPool(self.dsn, min_size=1, max_size=1, open=True)
        self._writer = EventWriter(self._pool)
        self._writer.write(Batch())
        self._next = 0
        self._seconds = 0.0
        return self._writer

    def write_one(self) -> None:
        """Write the cycle's next batch, if any is left (a window's cycle ends at ``rate``)."""
        if self._next >= len(self.batches):
            return
        writer = self._writer if self._next > 0 and self._writer else self._start_cycle()
        t = time.perf_counter()
        writer.write(self.batches[self._next])
        self._seconds += time.perf_counter() - t
        self._next += 1

    def rate(self) -> float:
        """Finish the current cycle, return its events/s, and start the next one afresh."""
        while self._next < len(self.batches):
            self.write_one()
        rate = self.events / self._seconds
        self._next = 0
        return rate

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def drop(self) -> None:
        self._close()
        with psycopg.connect(self.server_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


class ServerCounters:
    """Cumulative counters of the server, read at each window's end, so a window can say what
    the server did meanwhile: blocks read (not in shared buffers) and hit by the log's database,
    WAL written (the whole server: the baseline's too), checkpoints, and the vacuums and
    analyzes of the log's tables (autovacuum's, and the writers' analyze_partitions)."""

    FIELDS = (
        "blks_read",
        "blks_hit",
        "wal_bytes",
        "checkpoints",
        "autovacuum",
        "analyze",
        "backend_writes",
    )

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = int(conn.execute("SHOW server_version_num").fetchone()[0])  # type: ignore[index]
        self.checkpoints = (
            "SELECT num_timed + num_requested FROM pg_stat_checkpointer"
            if version >= 170000
            else "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
        )
        # Shared buffers that client backends (the writers) had to write out themselves to
        # make room, for want of a clean one: shared buffers or the background writer falling
        # behind the write rate.
        self.backend_writes = (
            "SELECT COALESCE(sum(writes), 0) FROM pg_stat_io WHERE backend_type = 'client backend'"
            if version >= 160000
            else "SELECT buffers_backend FROM pg_stat_bgwriter"
        )

    def read(self) -> dict[str, float]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT d.blks_read, d.blks_hit, (SELECT wal_bytes FROM pg_stat_wal),"
                f" ({self.checkpoints}),"
                " (SELECT COALESCE(sum(autovacuum_count + autoanalyze_count), 0)"
                "  FROM pg_stat_all_tables WHERE schemaname = 'agentcap'),"
                " (SELECT COALESCE(sum(analyze_count), 0)"
                "  FROM pg_stat_all_tables WHERE schemaname = 'agentcap'),"
                f" ({self.backend_writes})"
                " FROM pg_stat_database d WHERE d.datname = current_database()"
            ).fetchone()
        assert row is not None
        return {name: float(v) for name, v in zip(self.FIELDS, row, strict=True)}


@dataclass
class Window:
    events: int  # log size at the window's end
    rate: float  # events/s of the writer over the window
    baseline: float  # events/s of the baseline over the same minutes
    load: float
    counters: dict[str, float]  # differences over the window

    @property
    def ratio(self) -> float:
        return self.rate / self.baseline


class Log:
    """Generates runs in start order and writes them in batches through one EventWriter."""

    def __init__(
        self,
        pool: ConnectionPool[Any],
        batch: int,
        events_per_week: int,
        baseline: Baseline,
        baseline_every: int,
    ) -> None:
        self.writer = EventWriter(pool)
        self.batch = batch
        self.rng = random.Random(16)
        self.events = 0
        self.runs = 0
        self.seconds_per_event = 7 * 86400 / events_per_week
        self.pending: list[Run] = []
        self.pending_events = 0
        self.write_seconds = 0.0
        self.generate_seconds = 0.0
        self.baseline = baseline
        self.baseline_every = baseline_every
        self.batches = 0

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.events * self.seconds_per_event)

    def next_run(self, name: str | None = None, **shape: int) -> Run:
        t = time.perf_counter()
        workers = shape.get("workers", self.rng.randint(1, 6))
        steps = shape.get("steps", self.rng.randint(2, 20))
        run = make_run(
            name or f"run-{self.runs:07d}", self.now(), self.rng, workers=workers, steps=steps
        )
        self.runs += 1
        self.generate_seconds += time.perf_counter() - t
        return run

    def add(self, run: Run) -> None:
        self.pending.append(run)
        self.pending_events += len(run.events)
        if self.pending_events >= self.batch:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        events = tuple(e for r in self.pending for e in r.events)
        agents = tuple(a for r in self.pending for a in r.agents)
        runs = tuple(RunRecord(r.run_id, r.started, {"bench": True}) for r in self.pending)
        spans = tuple(x for r in self.pending for x in r.spans)
        t = time.perf_counter()
        result = self.writer.write(Batch(events, agents, runs, spans=spans))
        self.write_seconds += time.perf_counter() - t
        assert result.inserted == len(events), result
        self.events += len(events)
        self.pending = []
        self.pending_events = 0
        self.batches += 1
        if self.batches % self.baseline_every == 0:
            self.baseline.write_one()

    def grow_to(
        self, target: int, window: int, counters: ServerCounters, report: list[Window]
    ) -> None:
        """Write runs until ``target`` events; per window of ``window`` events append its rate,
        the baseline's over the same minutes, the load average and the server's counters."""
        mark_events, mark_time = self.events, self.write_seconds
        mark_counters = counters.read()
        while self.events < target:
            self.add(self.next_run())
            if self.events - mark_events >= window:
                rate = (self.events - mark_events) / (self.write_seconds - mark_time)
                base = self.baseline.rate()
                load = os.getloadavg()[0]
                now = counters.read()
                diff = {k: now[k] - mark_counters[k] for k in now}
                w = Window(self.events, rate, base, load, diff)
                report.append(w)
                n = self.events - mark_events
                print(
                    f"  {self.events:>11,} events  {rate:>8,.0f} events/s  baseline {base:>8,.0f}"
                    f"  ratio {w.ratio:.2f}  load {load:.1f}  per 1,000 events: blocks read"
                    f" {1000 * diff['blks_read'] / n:5.0f} hit {1000 * diff['blks_hit'] / n:6.0f},"
                    f" WAL {diff['wal_bytes'] / n:5.0f} bytes/event;"
                    f" checkpoints {diff['checkpoints']:.0f}, autovacuum/analyze"
                    f" {diff['autovacuum']:.0f}, analyze {diff['analyze']:.0f}; buffers written by"
                    f" backends {1000 * diff['backend_writes'] / n:.0f}; dirty {_dirty_mb()} MB",
                    flush=True,
                )
                mark_events, mark_time, mark_counters = self.events, self.write_seconds, now
        self.flush()


@dataclass(frozen=True)
class QueryFigures:
    """One query of one run: the first call (its pages may have left shared buffers) and the
    calls after it (warm), in milliseconds of the client's wall clock; and from EXPLAIN (ANALYZE,
    BUFFERS), median over warm calls, the server's planning and execution time and the shared
    buffers the statement touched, hit and read."""

    first_ms: float
    median_ms: float
    p10_ms: float
    p90_ms: float
    planning_ms: float
    execution_ms: float
    hit: int
    read: int

    def line(self) -> str:
        return (
            f"first {self.first_ms:7.2f} ms, warm median {self.median_ms:6.2f} ms"
            f" (p10 {self.p10_ms:5.2f}, p90 {self.p90_ms:5.2f}); server: planning"
            f" {self.planning_ms:5.3f} ms, execution {self.execution_ms:5.3f} ms,"
            f" buffers hit {self.hit}, read {self.read}"
        )


def _timed(fn: Any, repeat: int) -> tuple[float, list[float]]:
    """(first call, the next ``repeat``) in milliseconds."""
    t = time.perf_counter()
    fn()
    first = (time.perf_counter() - t) * 1000
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    return first, samples


def _explained(
    conn: psycopg.Connection[Any], queries: list[tuple[bytes, Any]], repeat: int
) -> tuple[float, float, int, int]:
    """Planning and execution milliseconds (medians over ``repeat`` warm runs) and shared
    buffers hit and read (of the last run), summed over ``queries``."""
    planning, execution, hit, read = 0.0, 0.0, 0, 0
    for query, params in queries:
        plans: list[float] = []
        execs: list[float] = []
        for _ in range(repeat):
            row = conn.execute(
                b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params, prepare=False
            ).fetchone()
            assert row is not None
            doc = row[0][0]
            plans.append(float(doc["Planning Time"]))
            execs.append(float(doc["Execution Time"]))
        planning += statistics.median(plans)
        execution += statistics.median(execs)
        hit += int(doc["Plan"]["Shared Hit Blocks"])
        read += int(doc["Plan"]["Shared Read Blocks"])
    return planning, execution, hit, read


def _figures(
    conn: psycopg.Connection[Any],
    fn: Any,
    queries: list[tuple[bytes, Any]],
    repeat: int,
) -> QueryFigures:
    first, samples = _timed(fn, repeat)
    cuts = statistics.quantiles(samples, n=10)
    planning, execution, hit, read = _explained(conn, queries, max(3, repeat // 4))
    return QueryFigures(
        first, statistics.median(samples), cuts[0], cuts[-1], planning, execution, hit, read
    )


def time_queries(dsn: str, runs: list[Run], repeat: int) -> dict[str, QueryFigures]:
    """Per run: figures of show (the run's events and agents, as ``otel-agentcap show`` reads
    them) and of the causal past of its last model call; and of the run list."""
    out: dict[str, QueryFigures] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for run in runs:
            last_call = max(
                (e for e in run.events if e.agent_id == "planner" and e.event_type == "model_call"),
                key=lambda e: e.seq,
            )
            size = len(run.events)

            def show(run_id: str = run.run_id, size: int = size) -> None:
                assert len(store.run_events(conn, run_id)) == size
                store.run_agents(conn, run_id)

            def past(
                run_id: str = run.run_id, event_id: str = last_call.event_id, size: int = size
            ) -> None:
                assert len(store.causal_past(conn, run_id, event_id)) == size - 2

            start = store.run_start(conn, run.run_id)
            params = {"run": run.run_id, "start": start, "event": last_call.event_id}
            out[f"show {run.run_id}"] = _figures(conn, show, [(store._EVENTS, params)], repeat)
            out[f"past {run.run_id}"] = _figures(conn, past, [(store._PAST, params)], repeat)
        out["runs (50)"] = _figures(
            conn,
            lambda: store.list_runs(conn, limit=50),
            [(store._LIST_RUNS, (50,))],
            repeat,
        )
    return out


def disk(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM agentcap.events),"
            " (SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c"
            "  WHERE c.relnamespace = 'agentcap'::regnamespace AND c.relkind = 'r'"
            "  AND c.relname NOT LIKE 'staging%%')"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def prune_with_writer(dsn: str, log: Log) -> None:
    """Prune the older half of the partitions while another writer keeps inserting new runs in
    batches of about 2,000 events; compare its batch latencies during the prune with before."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        parts = sorted({p.lower for p in partitions.list_partitions(conn, ["agentcap.events"])})
        real = [p for p in parts if p < log.now()]
        before = real[len(real) // 2]
    stop = threading.Event()
    latencies: list[tuple[float, float]] = []  # (end, seconds)
    inserted = [0]

    def keep_writing() -> None:
        with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
            writer = EventWriter(pool)
            rng = random.Random(99)
            i = 0
            while not stop.is_set():
                runs = [
                    make_run(f"during-prune-{i}-{k}", log.now(), rng, workers=3, steps=6)
                    for k in range(25)
                ]
                batch = Batch(
                    tuple(e for r in runs for e in r.events),
                    tuple(a for r in runs for a in r.agents),
                    spans=tuple(x for r in runs for x in r.spans),
                )
                t = time.perf_counter()
                inserted[0] += writer.write(batch).inserted
                latencies.append((time.perf_counter(), time.perf_counter() - t))
                i += 1
            writer.close()

    thread = threading.Thread(target=keep_writing)
    thread.start()
    time.sleep(10)
    with psycopg.connect(dsn, autocommit=True) as conn:
        t0 = time.perf_counter()
        result = retention.prune(conn, before)
        t1 = time.perf_counter()
    time.sleep(2)
    stop.set()
    thread.join()
    events_parts = [p for p in result.partitions if p.table == "agentcap.events"]
    print(
        f"\nprune --before {before.date()}: {len(events_parts)} ranges, {result.runs:,} runs, "
        f"{t1 - t0:.1f} s in all"
    )
    for p in result.partitions:
        print(f"  {p.partition:<34} detach + drop {p.seconds:6.2f} s")
    per = [p.seconds for p in events_parts]
    if per:
        print(
            f"  per events partition: median {statistics.median(per):.2f} s, max {max(per):.2f} s"
        )
    print(f"  rows deleted from unpartitioned tables: {result.rows}")
    print(f"  a second writer inserted {inserted[0]:,} events in batches of ~2,000 meanwhile:")
    before_prune = [s for end, s in latencies if end < t0]
    during = [s for end, s in latencies if end > t0 and end - s < t1]
    for name, values in (("before the prune", before_prune), ("during the prune", during)):
        if values:
            print(
                f"    {name}: {len(values)} batches, median {statistics.median(values):.3f} s,"
                f" max {max(values):.3f} s"
            )


def _dirty_mb() -> str:
    """Dirty page cache of the machine waiting to be written back (Linux), in MB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Dirty:"):
                return f"{int(line.split()[1]) // 1024:,}"
    except OSError:
        pass
    return "?"


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--batch", type=int, default=2_000)
    parser.add_argument("--window", type=int, default=250_000)
    parser.add_argument("--interval", default="7 days")
    parser.add_argument("--events-per-week", type=int, default=500_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--dsn")
    parser.add_argument("--keep", action="store_true", help="keep the embedded server's data")
    args = parser.parse_args()

    root = None
    if args.dsn:
        dsn = args.dsn
    else:
        root = Path(tempfile.mkdtemp(prefix="agentcap-scale-"))
        dsn = embedded.start(root / "pg")
    print(f"uptime at start: {_uptime()}; cpus: {os.cpu_count()}")
    try:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            partitions.set_partition_interval(conn, args.interval)
            settings = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
                for name in (
                    "server_version",
                    "shared_buffers",
                    "max_wal_size",
                    "synchronous_commit",
                )
            }
        print(f"server: {settings}; partition interval {args.interval}; batch {args.batch}")
        baseline = Baseline(embedded.dsn_for(dsn, "postgres"), args.interval)
        counters = ServerCounters(dsn)
        windows: list[Window] = []
        results: list[tuple[dict[str, QueryFigures], tuple[int, int], int]] = []
        # One baseline cycle (its 20,000 events) spread over each window.
        every = max(1, args.window // args.batch // len(baseline.batches))
        with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
            log = Log(pool, args.batch, args.events_per_week, baseline, every)
            # The timed runs: two written first (old partitions by the end), and at each size one
            # written just before measuring.
            reference = [log.next_run(f"ref-early-{i}", **REFERENCE) for i in range(2)]
            for run in reference:
                log.add(run)
            for size in sorted(args.sizes):
                print(f"growing to {size:,} events", flush=True)
                log.grow_to(size - len(reference[0].events), args.window, counters, windows)
                recent = log.next_run(f"ref-at-{size}", **REFERENCE)
                log.add(recent)
                log.flush()
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("ANALYZE agentcap.runs, agentcap.agents")
                    parts = len(partitions.list_partitions(conn, [partitions.EVENTS_TABLE]))
                timed = time_queries(dsn, [*reference, recent], args.repeat)
                results.append((timed, disk(dsn), parts))
                count, size_bytes = results[-1][1]
                print(
                    f"  at {count:,} events ({parts} events partitions):"
                    f" {size_bytes / count:,.0f} bytes per event on disk; uptime: {_uptime()}"
                )
                for name, figures in timed.items():
                    print(f"    {name:<18} {figures.line()}")
            print(
                f"\ngeneration (client) {log.generate_seconds:.0f} s, writer {log.write_seconds:.0f} s"
            )
            prune_with_writer(dsn, log)
        baseline.drop()
        print("\nsummary")
        k = min(4, max(1, len(windows) // 4))
        for name, group in (("first", windows[:k]), ("last", windows[-k:])):
            rates = [w.rate for w in group]
            ratios = [w.ratio for w in group]
            print(
                f"  insert throughput, {name} {k} windows: median {statistics.median(rates):,.0f}"
                f" events/s (min {min(rates):,.0f}, max {max(rates):,.0f}); divided by the"
                f" baseline: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max"
                f" {max(ratios):.2f}); load {', '.join(f'{w.load:.1f}' for w in group)}"
            )
        head, tail = windows[:k], windows[-k:]
        raw = statistics.median(w.rate for w in tail) / statistics.median(w.rate for w in head)
        normalized = statistics.median(w.ratio for w in tail) / statistics.median(
            w.ratio for w in head
        )
        print(
            f"  last/first (medians of {k} windows): raw {raw:.2f}, divided by the baseline"
            f" {normalized:.2f} (target >= 0.8); single windows: raw"
            f" {windows[-1].rate / windows[0].rate:.2f}, divided"
            f" {windows[-1].ratio / windows[0].ratio:.2f}"
        )
        ratios = [w.ratio for w in windows]
        print(
            f"  divided by the baseline, all {len(windows)} windows: min {min(ratios):.2f},"
            f" median {statistics.median(ratios):.2f}, max {max(ratios):.2f}"
        )
        for timed, (count, size_bytes), parts in results:
            print(
                f"  {count:>11,} events, {parts} partitions, {size_bytes / count:,.0f} bytes/event"
            )
            for name in ("show ref-early-0", "past ref-early-0", "runs (50)"):
                print(f"    {name:<18} {timed[name].line()}")
        print(f"uptime at end: {_uptime()}")
    finally:
        if root is not None:
            if args.keep:
                print(f"data kept in {root / 'pg'} (server still running: {dsn})")
            else:
                embedded.destroy(root / "pg")
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
