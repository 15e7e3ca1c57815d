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

The machine's speed varies with other work, so after each window of ``--window`` events the same
20,000 events are written into an empty log in another database of the same server: the window's
rate divided by that baseline's rate is the figure compared between the start and the end.

Targets: that normalized insert throughput over the last window at least 0.8 of the first; show
and causal-past times flat (within noise) from 1 to 10 million events. Not a test: it takes tens
of minutes.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
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
    """The same 20,000 events written into an empty log of another database: the server's speed
    at the moment, to divide a window's rate by."""

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

    def rate(self) -> float:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                "TRUNCATE agentcap.events, agentcap.conflicts, agentcap.runs, agentcap.agents"
            )
        with ConnectionPool(self.dsn, min_size=1, max_size=1, open=True) as pool:
            writer = EventWriter(pool)
            writer.write(Batch())
            t = time.perf_counter()
            for batch in self.batches:
                writer.write(batch)
            seconds = time.perf_counter() - t
            writer.close()
        return self.events / seconds

    def drop(self) -> None:
        with psycopg.connect(self.server_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


class Log:
    """Generates runs in start order and writes them in batches through one EventWriter."""

    def __init__(self, pool: ConnectionPool[Any], batch: int, events_per_week: int) -> None:
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

    def grow_to(
        self,
        target: int,
        window: int,
        baseline: Baseline,
        report: list[tuple[int, float, float, float]],
    ) -> None:
        """Write runs until ``target`` events; per window append (events, events/s, baseline
        events/s, load average)."""
        mark_events, mark_time = self.events, self.write_seconds
        while self.events < target:
            self.add(self.next_run())
            if self.events - mark_events >= window:
                rate = (self.events - mark_events) / (self.write_seconds - mark_time)
                base = baseline.rate()
                load = os.getloadavg()[0]
                report.append((self.events, rate, base, load))
                print(
                    f"  {self.events:>11,} events  {rate:>8,.0f} events/s  baseline {base:>8,.0f}"
                    f"  ratio {rate / base:.2f}  load {load:.1f}",
                    flush=True,
                )
                mark_events, mark_time = self.events, self.write_seconds
        self.flush()


def _median_ms(fn: Any, repeat: int) -> tuple[float, float]:
    """(first call, median of the next ``repeat``) in milliseconds."""
    t = time.perf_counter()
    fn()
    first = (time.perf_counter() - t) * 1000
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    return first, statistics.median(samples)


def _buffers(conn: psycopg.Connection[Any], query: bytes, params: dict[str, Any]) -> int:
    """Shared buffers (hit or read) the query touches: its cost, whatever the machine's load."""
    row = conn.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def time_queries(dsn: str, runs: list[Run], repeat: int) -> dict[str, tuple[float, float]]:
    """Per run: (first, median) milliseconds of show and of the causal past of its last model
    call, and (buffers, buffers) of the same two queries."""
    out: dict[str, tuple[float, float]] = {}
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

            out[f"show {run.run_id}"] = _median_ms(show, repeat)
            out[f"past {run.run_id}"] = _median_ms(past, repeat)
            params = {
                "run": run.run_id,
                "start": store.run_start(conn, run.run_id),
                "event": last_call.event_id,
            }
            show_buffers = _buffers(conn, store._EVENTS, params)
            past_buffers = _buffers(conn, store._PAST, params)
            out[f"buffers {run.run_id}"] = (show_buffers, past_buffers)
        out["runs (50)"] = _median_ms(lambda: store.list_runs(conn, limit=50), repeat)
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
    print(f"load average at start: {os.getloadavg()}, cpus: {os.cpu_count()}")
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
        windows: list[tuple[int, float, float, float]] = []
        results: list[tuple[dict[str, tuple[float, float]], tuple[int, int]]] = []
        with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
            log = Log(pool, args.batch, args.events_per_week)
            # The timed runs: two written first (old partitions by the end), and at each size one
            # written just before measuring.
            reference = [log.next_run(f"ref-early-{i}", **REFERENCE) for i in range(2)]
            for run in reference:
                log.add(run)
            for size in sorted(args.sizes):
                print(f"growing to {size:,} events", flush=True)
                log.grow_to(size - len(reference[0].events), args.window, baseline, windows)
                recent = log.next_run(f"ref-at-{size}", **REFERENCE)
                log.add(recent)
                log.flush()
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("ANALYZE agentcap.runs, agentcap.agents")
                timed = time_queries(dsn, [*reference, recent], args.repeat)
                results.append((timed, disk(dsn)))
                count, size_bytes = results[-1][1]
                print(f"  at {count:,} events: {size_bytes / count:,.0f} bytes per event on disk")
                for name, (first, median) in timed.items():
                    if name.startswith("buffers"):
                        print(f"    {name:<28} show {first:.0f}, causal past {median:.0f} buffers")
                    else:
                        print(f"    {name:<28} first {first:8.2f} ms   median {median:7.2f} ms")
            print(
                f"\ngeneration (client) {log.generate_seconds:.0f} s, writer {log.write_seconds:.0f} s"
            )
            prune_with_writer(dsn, log)
        baseline.drop()
        first, last = windows[0], windows[-1]
        print("\nsummary")
        for name, w in (("first", first), ("last", last)):
            print(
                f"  insert throughput, {name} window: {w[1]:,.0f} events/s, baseline"
                f" {w[2]:,.0f}, normalized {w[1] / w[2]:.2f} (load {w[3]:.1f})"
            )
        print(
            f"  normalized last/first: {(last[1] / last[2]) / (first[1] / first[2]):.2f}"
            f" (target >= 0.8); raw last/first {last[1] / first[1]:.2f}"
        )
        normalized = [w[1] / w[2] for w in windows]
        print(
            f"  normalized, all windows: min {min(normalized):.2f}, median"
            f" {statistics.median(normalized):.2f}, max {max(normalized):.2f}"
        )
        for timed, (count, size_bytes) in results:
            show = timed["show ref-early-0"][1]
            past = timed["past ref-early-0"][1]
            show_buffers, past_buffers = timed["buffers ref-early-0"]
            print(
                f"  {count:>11,} events: show {show:6.2f} ms ({show_buffers:.0f} buffers), causal"
                f" past {past:6.2f} ms ({past_buffers:.0f} buffers) (ref-early-0, median),"
                f" {size_bytes / count:,.0f} bytes/event"
            )
        print(f"load average at end: {os.getloadavg()}")
    finally:
        if root is not None:
            if args.keep:
                print(f"data kept in {root / 'pg'} (server still running: {dsn})")
            else:
                embedded.destroy(root / "pg")
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
