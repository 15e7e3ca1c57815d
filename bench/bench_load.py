"""Sustained load from several processes through configure() and the durable queue, optionally
with a fault in the middle, and an account of every event: captured, stored, duplicates, lost.

Each worker process captures operations at a given rate for a given time, all in one run and one
shared agent (so their sequences must never collide): a memory write, a memory read naming it as
causal parent, a tool call (two events), in turn. Before each operation it writes into a counter
file in shared memory, which survives a SIGKILL, how many events it has captured and how many it
will have once the operation returns; so the account is exact even for a killed worker, up to the
one operation it was in (whose events may or may not have been captured when it died).

Faults (``--fault``):

* ``pg-restart``: PostgreSQL is stopped at ``--fault-at`` seconds for ``--fault-for`` seconds
  (only with the embedded server this script starts, the default);
* ``sigkill``: the first worker is killed with SIGKILL at ``--fault-at`` and a new worker takes
  its place for the rest of the time, on the same queue directory (it delivers what the killed
  one left);
* ``down-at-shutdown``: PostgreSQL is stopped at ``--fault-at`` and stays down while the workers
  finish and shut down; then it starts again and one more worker runs for 2 s on the same queue
  directory (it delivers what they left).

At the end it prints, per worker and in all: captured, stored, duplicates (re-sent events the log
recognised), conflicts, causal parents that name no stored event, lost counted (dropped or
refused, in the workers' stats) and lost uncounted (captured, neither stored nor counted), and the
sustained rate (stored events over the load time). Events a killed worker stored from the
operation it was in are shown apart; more stored than any worker could have captured is an error.

    .venv/bin/python bench/bench_load.py [--processes 2] [--rate 1000] [--seconds 20]
        [--fault none|pg-restart|sigkill|down-at-shutdown] [--fault-at 6] [--fault-for 5] [--dsn DSN]
        [--tool-ledger on|off] [--workload mixed|spawn|pgmemory|async|runs|model]

``--workload`` other than ``mixed`` (the one above): ``spawn`` (each process spawns children of
the shared agent ``parent``; the next process retries the spawn 20 operations later, which finds
it in the registry, and runs the child: a tool call), ``pgmemory`` (``PostgresMemory`` writes and
reads of 7 keys shared by the processes; ``MemoryUnavailable`` is counted apart), ``async`` (per
operation four asyncio tasks calling an async tool, then two threads calling a tool and a
``Memory``), ``runs`` (per operation one short run, of 50 run ids every process reopens), ``model`` (per
operation a model call through the anthropic SDK to the test Messages server, and a tool call). Their
events are counted exactly: a span processor maps each ended span to its events.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

RUN = "bench-load"


def worker(args: argparse.Namespace) -> None:
    if args.workload != "mixed":
        other_worker(args)
        return
    import dataclasses

    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    fd = os.open(args.counter, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 16)
    counter = mmap.mmap(fd, 16)

    def count(done: int, in_progress: int = 0) -> None:
        # Written before an operation (its events in flight) and after it (none in flight).
        counter[0:16] = struct.pack("<QQ", done, done + in_progress)

    agentcap = configure(
        args.dsn,
        queue_dir=args.queue_dir,
        announce=False,
        shutdown_timeout=60,
        tool_ledger=args.tool_ledger == "on",
    )
    memory = ac.Memory("m")

    @ac.tool
    def tool(x: int) -> int:
        return x + 1

    events = 0
    started = time.monotonic()
    deadline = started + args.seconds
    i = 0
    count(0, 1)
    with ac.run(RUN, resume=True), ac.agent("shared"):  # all workers share one run
        events += 1  # agent_start (queued when the agent starts)
        count(events)
        while time.monotonic() < deadline:
            pause = started + i / args.rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            kind = i % 3
            if kind == 0:
                count(events, 1)
                memory[f"{args.name}-{i % 10}"] = {"op": i, "note": "x" * 200}
                events += 1
            elif kind == 1:
                count(events, 1)
                memory.get(f"{args.name}-{(i - 1) % 10}")
                events += 1
            else:
                count(events, 2)
                tool.invoke(f"{args.name}-{i}", i)
                events += 2
            i += 1
            count(events)
        count(events, 1)
    events += 1  # agent_end
    count(events)
    agentcap.shutdown(60)
    print(json.dumps({"events": events, "stats": dataclasses.asdict(agentcap.stats())}), flush=True)


def other_worker(args: argparse.Namespace) -> None:
    """The workloads other than ``mixed``. Captured events are counted exactly: a span processor
    added after configure()'s maps every ended span to its events (as the exporter will) and
    counts their distinct ids; the counter file holds that count and, during an operation, an
    upper bound of what the operation may add (for a killed worker)."""
    import asyncio
    import dataclasses
    import threading

    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

    import otel_agentcap as ac
    from otel_agentcap.configure import configure
    from otel_agentcap.errors import MemoryUnavailable
    from otel_agentcap.pipeline.mapping import events_from_span

    fd = os.open(args.counter, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 16)
    counter = mmap.mmap(fd, 16)
    seen: set[str] = set()
    lock = threading.Lock()

    def count(in_progress: int = 0) -> None:
        with lock:
            done = len(seen)
            counter[0:16] = struct.pack("<QQ", done, done + in_progress)

    class Counting(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            try:
                ids = [str(e.event_id) for e in events_from_span(span)]
            except Exception:  # a span without events: nothing to count
                return
            with lock:
                seen.update(ids)
                done = len(seen)
                _, upto = struct.unpack("<QQ", counter[0:16])
                counter[0:16] = struct.pack("<QQ", done, max(done, upto))

    agentcap = configure(
        args.dsn,
        queue_dir=args.queue_dir,
        announce=False,
        shutdown_timeout=60,
        tool_ledger=args.tool_ledger == "on",
    )
    agentcap.provider.add_span_processor(Counting())
    slot = args.name.split("-")[0]  # a restarted worker keeps its slot
    peers = [f"p{k}" for k in range(args.processes) if f"p{k}" != slot] or [slot]
    unavailable = 0

    @ac.tool
    def tool(x: int) -> int:
        return x + 1

    @ac.tool
    async def atool(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    started = time.monotonic()
    deadline = started + args.seconds

    def pace(i: int) -> bool:
        pause = started + i / args.rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        return time.monotonic() < deadline

    if args.workload == "spawn":
        # Each slot spawns children in the shared agent "parent"; a peer slot starts them
        # (a retried spawn, found in the registry) and runs them in its own process.
        def step(x: int) -> int:
            return tool.invoke(f"step-{x}", x)

        with ac.run(RUN, resume=True):
            count(2)
            with ac.agent("parent") as parent:
                i = 0
                while pace(i):
                    count(6)
                    parent.spawn("child", key=f"{slot}-{i}")
                    peer = peers[i % len(peers)]
                    if i >= 20:
                        child = parent.spawn("child", key=f"{peer}-{i - 20}")
                        child.run(step, i)
                    i += 1
                    count()
                count(1)
    elif args.workload == "pgmemory":
        from otel_agentcap.exporters.postgres import PostgresMemory

        with ac.run(RUN, resume=True):
            memory = PostgresMemory("shared")
            count(2)
            with ac.agent("shared"):
                i = 0
                while pace(i):
                    count(2)
                    try:
                        if i % 2 == 0:
                            memory[f"k{i % 7}"] = {"by": args.name, "op": i}
                        else:
                            memory.get(f"k{(i * 3) % 7}")
                    except MemoryUnavailable:
                        unavailable += 1
                    i += 1
                    count()
                count(1)
    elif args.workload == "async":
        # Per operation: four asyncio tasks calling an async tool in one agent, and two
        # threads (carrying the context) calling a sync tool and a process Memory.
        memory = ac.Memory("m")

        def in_thread(i: int, j: int) -> None:
            tool.invoke(f"{args.name}-{i}-t{j}", i)
            memory[f"{args.name}-{j}"] = i
            memory.get(f"{args.name}-{j}")

        async def main() -> None:
            async with ac.agent("shared"):
                i = 0
                while pace(i):
                    count(16)
                    await asyncio.gather(
                        *(atool.invoke(f"{args.name}-{i}-a{j}", i) for j in range(4))
                    )
                    threads = [ac.start_thread(in_thread, i, j) for j in range(2)]
                    for t in threads:
                        t.join()
                    i += 1
                    count()
                count(1)

        with ac.run(RUN, resume=True):
            count(2)
            asyncio.run(main())
    elif args.workload == "runs":
        # Many short runs, each opened and closed again and again by every process.
        i = 0
        while pace(i):
            count(8)
            with ac.run(f"{RUN}-{i % 50}", resume=True), ac.agent("shared"):
                tool.invoke(f"{args.name}-{i}", i)
            i += 1
            count()
    elif args.workload == "model":
        # Per operation a model call through the anthropic SDK (against the test Messages
        # server of this process) and a tool call, in the shared agent.
        import anthropic

        from otel_agentcap.testing.messages_server import MessagesServer

        with MessagesServer() as server, ac.run(RUN, resume=True):
            client = anthropic.Anthropic(base_url=server.base_url, api_key="test", max_retries=0)
            count(2)
            with ac.agent("shared"):
                i = 0
                while pace(i):
                    count(3)
                    client.messages.create(
                        model="claude-test",
                        max_tokens=16,
                        messages=[{"role": "user", "content": f"{args.name} {i}"}],
                    )
                    tool.invoke(f"{args.name}-{i}", i)
                    i += 1
                    count()
                count(1)
    else:
        raise SystemExit(f"unknown workload {args.workload}")
    count()
    agentcap.shutdown(60)
    count()
    print(
        json.dumps(
            {
                "events": len(seen),
                "unavailable": unavailable,
                "stats": dataclasses.asdict(agentcap.stats()),
            }
        ),
        flush=True,
    )


@dataclass
class Worker:
    name: str
    counter: Path
    proc: subprocess.Popen[str]
    killed: bool = False
    result: dict[str, Any] = field(default_factory=dict)

    def captured(self) -> int:
        """Events captured by operations that returned."""
        return self._counts()[0]

    def in_flight(self) -> int:
        """Events of the operation the worker was in when it stopped (a killed worker)."""
        done, upto = self._counts()
        return upto - done

    def _counts(self) -> tuple[int, int]:
        data = self.counter.read_bytes() if self.counter.exists() else b""
        return struct.unpack("<QQ", data[:16]) if len(data) >= 16 else (0, 0)


def start_worker(args: argparse.Namespace, name: str, seconds: float, root: Path) -> Worker:
    counter = root / f"{name}.counter"
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--worker",
            "--name",
            name,
            "--dsn",
            args.dsn,
            "--queue-dir",
            str(root / "queue"),
            "--counter",
            str(counter),
            "--rate",
            str(args.rate),
            "--seconds",
            str(seconds),
            "--tool-ledger",
            args.tool_ledger,
            "--workload",
            args.workload,
            "--processes",
            str(args.processes),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Worker(name, counter, proc)


def query(dsn: str, sql: str) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql).fetchone()
    return row[0] if row else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="w")
    parser.add_argument("--counter")
    parser.add_argument("--queue-dir")
    parser.add_argument("--dsn")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1000.0, help="operations/s per process")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument(
        "--fault", choices=["none", "pg-restart", "sigkill", "down-at-shutdown"], default="none"
    )
    parser.add_argument("--fault-at", type=float, default=6.0)
    parser.add_argument("--fault-for", type=float, default=5.0)
    parser.add_argument(
        "--tool-ledger",
        choices=["on", "off"],
        default="on",
        help="configure()'s tool ledger (on by default): two commits per tool call",
    )
    parser.add_argument(
        "--workload",
        choices=["mixed", "spawn", "pgmemory", "async", "runs", "model"],
        default="mixed",
        help="mixed (memory write, read, tool call); spawn (children spawned in one process, "
        "started in another); pgmemory (PostgresMemory shared by the processes); async "
        "(asyncio tool calls and threads); runs (short runs opened again and again); model "
        "(anthropic SDK calls to the test Messages server, and a tool call)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from otel_agentcap.exporters.postgres import embedded
    from otel_agentcap.exporters.postgres.migrate import migrate

    root = Path(tempfile.mkdtemp(prefix="agentcap-bench-load-"))
    pg_dir = root / "pg"
    own_server = args.dsn is None
    if args.fault in ("pg-restart", "down-at-shutdown") and not own_server:
        parser.error(f"{args.fault} needs the embedded server this script starts (no --dsn)")
    try:
        if own_server:
            admin = embedded.start(pg_dir, database="postgres")
            name = f"load_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            args.dsn = embedded.dsn_for(admin, name)
        migrate(args.dsn)
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM agentcap.events WHERE run_id = %s", (RUN,))
        workers = [start_worker(args, f"p{i}", args.seconds, root) for i in range(args.processes)]
        began = time.monotonic()
        if args.fault != "none":
            time.sleep(max(0.0, began + args.fault_at - time.monotonic()))
            if args.fault == "pg-restart":
                embedded.stop(pg_dir)
                print(f"t={time.monotonic() - began:5.1f}s  PostgreSQL stopped", flush=True)
                time.sleep(args.fault_for)
                embedded.start(pg_dir, database="postgres")
                print(f"t={time.monotonic() - began:5.1f}s  PostgreSQL started", flush=True)
            elif args.fault == "down-at-shutdown":
                embedded.stop(pg_dir)
                print(f"t={time.monotonic() - began:5.1f}s  PostgreSQL stopped", flush=True)
                for w in workers:
                    out, err = w.proc.communicate(timeout=600)
                    if w.proc.returncode != 0:
                        print(err[-3000:], file=sys.stderr)
                        raise SystemExit(f"worker {w.name} failed")
                    w.result = json.loads(out.strip().splitlines()[-1])
                print(
                    f"t={time.monotonic() - began:5.1f}s  workers shut down; "
                    f"spans left: {sum(w.result['stats']['spans_left'] for w in workers):,}",
                    flush=True,
                )
                embedded.start(pg_dir, database="postgres")
                print(f"t={time.monotonic() - began:5.1f}s  PostgreSQL started", flush=True)
                workers.append(start_worker(args, "p0-after", 2.0, root))
            else:
                victim = workers[0]
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(30)
                victim.killed = True
                print(
                    f"t={time.monotonic() - began:5.1f}s  {victim.name} killed with SIGKILL "
                    f"after capturing {victim.captured()} events",
                    flush=True,
                )
                rest = max(1.0, args.seconds - (time.monotonic() - began))
                workers.append(start_worker(args, f"{victim.name}-restarted", rest, root))
        for w in workers:
            if w.killed or w.result:
                continue
            out, err = w.proc.communicate(timeout=600)
            if w.proc.returncode != 0:
                print(err[-3000:], file=sys.stderr)
                raise SystemExit(f"worker {w.name} failed")
            w.result = json.loads(out.strip().splitlines()[-1])
            if os.environ.get("BENCH_LOAD_STDERR"):
                print(f"--- {w.name} stderr\n{err[-4000:]}", file=sys.stderr)
        load_seconds = args.seconds

        stored = query(args.dsn, f"SELECT count(*) FROM agentcap.events WHERE run_id LIKE '{RUN}%'")
        distinct = query(
            args.dsn,
            "SELECT count(DISTINCT (run_id, agent_id, logical_seq)) FROM agentcap.events "
            f"WHERE run_id LIKE '{RUN}%'",
        )
        conflicts = query(
            args.dsn, f"SELECT count(*) FROM agentcap.conflicts WHERE run_id LIKE '{RUN}%'"
        )
        dangling = query(
            args.dsn,
            "SELECT count(*) FROM agentcap.events e, unnest(e.causal_parent_ids) p "
            f"WHERE e.run_id LIKE '{RUN}%' AND NOT EXISTS "
            "(SELECT 1 FROM agentcap.events x WHERE x.event_id = p)",
        )
        # Invariant 2 (Lamport): an event whose sequence is not above a stored causal parent's.
        lamport = query(
            args.dsn,
            "SELECT count(*) FROM agentcap.events e, unnest(e.causal_parent_ids) p, "
            "agentcap.events x WHERE e.run_id LIKE '{RUN}%' AND x.run_id = e.run_id "
            "AND x.event_id = p AND e.logical_seq <= x.logical_seq".replace("{RUN}", RUN),
        )
        if conflicts:
            with psycopg.connect(args.dsn) as conn:
                for kind, reason, n in conn.execute(
                    "SELECT event_type, reason, count(*) FROM agentcap.conflicts "
                    f"WHERE run_id LIKE '{RUN}%' GROUP BY 1, 2 ORDER BY 3 DESC"
                ):
                    print(f"  conflicts: {n:,} {kind} ({reason})")
        captured = sum(w.captured() for w in workers)
        in_flight = sum(w.in_flight() for w in workers)
        stats = [w.result.get("stats", {}) for w in workers]
        duplicates = sum(s.get("duplicates", 0) for s in stats)
        counted = sum(s.get("events_dropped", 0) + s.get("events_failed", 0) for s in stats)
        print(
            f"processes={args.processes} rate={args.rate:,.0f} ops/s each seconds={args.seconds} "
            f"fault={args.fault} workload={args.workload}"
        )
        for w in workers:
            s = w.result.get("stats", {})
            print(
                f"  {w.name:14s} captured={w.captured():>7,} "
                + (
                    "(killed)"
                    if w.killed
                    else f"stored by it={s.get('events_inserted', 0):>7,} "
                    f"adopted spans={s.get('spans_adopted', 0):,} retries={s.get('failed_attempts', 0)}"
                )
            )
        print(f"captured:          {captured:>9,}")
        print(f"stored:            {stored:>9,}  (distinct agent/sequence pairs: {distinct:,})")
        print(f"duplicates:        {duplicates:>9,}  (re-sent, recognised, stored once)")
        print(f"conflicts:         {conflicts:>9,}")
        print(f"dangling parents:  {dangling:>9,}")
        print(f"Lamport breaches:  {lamport:>9,}  (events not above a stored causal parent)")
        print(f"lost, counted:     {counted:>9,}")
        unavailable = sum(w.result.get("unavailable", 0) for w in workers)
        if unavailable:
            print(
                f"MemoryUnavailable: {unavailable:>9,}  (operations refused while the database was down)"
            )
        # A killed worker's last operation may have captured its events before it died.
        beyond = min(max(0, stored + counted - captured), in_flight)
        if in_flight:
            print(
                f"stored from operations a killed worker was in: {beyond:,} of at most "
                f"{in_flight:,} (their events may or may not have been captured before the kill)"
            )
        print(f"lost, uncounted:   {captured + beyond - stored - counted:>9,}")
        if stored + counted > captured + in_flight:
            print("error: more events stored than the workers captured", file=sys.stderr)
            raise SystemExit(1)
        print(f"sustained rate:    {stored / load_seconds:>9,.0f} events/s stored over the load")
    finally:
        if os.environ.get("BENCH_LOAD_KEEP") and own_server:
            print(f"kept: {pg_dir} {args.dsn}", file=sys.stderr)
        else:
            if own_server:
                embedded.destroy(pg_dir)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
