"""Thread scaling of captured tool calls against bare SDK spans, in one process.

Each of 1, 2, 4 and 8 threads runs its own agent of one run and makes captured tool calls
(``tool.invoke`` with a new invocation id each time) through a TracerProvider with
AgentCapSpanProcessor and a SimpleSpanProcessor to an exporter that drops everything. The baseline
is bare SDK spans with as many attributes, started and ended in the same threads on a second
provider with the same null exporter. For each thread count the figure is the total rate (calls
per second over all threads, wall time) relative to the one-thread rate of the same kind; with
the GIL the ideal is 1.0 at every thread count (the threads share one core's worth of Python),
and anything process-wide that every call contends for shows up as a fall below it.

``--ledger`` runs the captured calls with the PostgreSQL tool ledger on (PostgresToolLedger on
an embedded PostgreSQL in a temporary directory, or on ``--dsn``), so every call also claims and
completes its invocation there (``--fast-commit``: a ledger with ``durable=False``); the bare
baseline is unchanged. The pool has a connection per thread.

In every round, for each kind and thread count n, a block at n threads and a block at one thread
are timed back to back (in alternating order); the scaling at n is the median over rounds of their
ratio, so load from other processes, which slows both blocks alike, mostly cancels out. Rates are
medians too.

    .venv/bin/python bench/bench_threads.py [--rounds 11] [--calls 3000]
    .venv/bin/python bench/bench_threads.py --ledger [--fast-commit] [--dsn DSN] [--calls 400]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import otel_agentcap as oa
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor

THREADS = (1, 2, 4, 8)


class DropExporter(SpanExporter):
    def __init__(self) -> None:
        self.last: ReadableSpan | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.last = spans[-1]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _timed(threads: int, work: Callable[[int], None]) -> float:
    """Wall seconds for ``threads`` threads each running ``work(i)``, started together."""
    barrier = threading.Barrier(threads + 1)
    done = threading.Barrier(threads + 1)

    def target(i: int) -> None:
        barrier.wait()
        work(i)
        done.wait()

    pool = [oa.start_thread(target, i) for i in range(threads)]
    barrier.wait()
    start = time.perf_counter()
    done.wait()
    elapsed = time.perf_counter() - start
    for thread in pool:
        thread.join()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, help="calls per round, all threads")
    parser.add_argument("--ledger", action="store_true", help="protect calls with the tool ledger")
    parser.add_argument("--fast-commit", action="store_true", help="ledger with durable=False")
    parser.add_argument("--dsn", help="the ledger's database (default: an embedded one)")
    args = parser.parse_args()
    if args.calls is None:
        args.calls = 400 if args.ledger else 3000
    data_dir = None
    try:
        if args.ledger and not args.dsn:
            from otel_agentcap.exporters.postgres import embedded

            data_dir = Path(tempfile.mkdtemp(prefix="agentcap-bench-")) / "pg"
            args.dsn = embedded.start(data_dir, database="postgres")
        measure(args)
    finally:
        if data_dir is not None:
            from otel_agentcap.exporters.postgres import embedded

            embedded.destroy(data_dir)


def measure(args: argparse.Namespace) -> None:

    exporter = DropExporter()
    provider = TracerProvider()
    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    ledger = None
    if args.ledger:
        from otel_agentcap.capture.ledger import set_tool_ledger
        from otel_agentcap.exporters.postgres import Database, migrate
        from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger

        migrate(args.dsn)
        database = Database(args.dsn, max_size=max(THREADS) + 2)
        ledger = PostgresToolLedger(database, lease=3600.0, durable=not args.fast_commit)
        set_tool_ledger(ledger)

    bare_provider = TracerProvider()
    bare_provider.add_span_processor(SimpleSpanProcessor(DropExporter()))
    bare_tracer = bare_provider.get_tracer("bench.bare")

    @oa.tool
    def lookup(city: str, days: int = 3) -> dict[str, object]:
        return {"city": city, "forecast": ["sun"] * days}

    run_id = f"bench-threads-{time.time_ns()}"
    counter = itertools.count()
    with oa.run(run_id, resume=True), oa.agent("warmup"):
        lookup.invoke("warmup", "Oslo")
        assert exporter.last is not None
        n_attributes = len(exporter.last.attributes or {})  # the execute_tool span
    attributes = {f"bench.attr.{i}": f"value-{i}" for i in range(n_attributes)}

    def captured(threads: int) -> Callable[[int], None]:
        per_thread = args.calls // threads

        def work(i: int) -> None:
            with oa.run(run_id, resume=True), oa.agent(f"agent-{i}"):
                for _ in range(per_thread):
                    lookup.invoke(f"call-{next(counter)}", "Oslo", days=2)

        return work

    def bare(threads: int) -> Callable[[int], None]:
        per_thread = args.calls // threads

        def work(i: int) -> None:
            for _ in range(per_thread):
                bare_tracer.start_span("execute_tool lookup", attributes=attributes).end()

        return work

    kinds = {"captured": captured, "bare": bare}
    rates: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kinds for n in THREADS}
    # Per round and kind, the rate at n threads over the rate at one thread measured right
    # before or after it: other processes on the machine slow both alike.
    scalings: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kinds for n in THREADS}
    for make in kinds.values():  # warm up every pair once
        for n in THREADS:
            _timed(n, make(n))
    with oa.run(run_id, resume=True):  # the run stays open, as in a long-running worker
        for r in range(args.rounds):
            for kind, make in kinds.items():
                for n in THREADS[1:] if r % 2 else THREADS[:0:-1]:
                    calls = (args.calls // n) * n
                    order = (1, n) if r % 2 else (n, 1)
                    measured = {}
                    for threads in order:
                        total = (calls // threads) * threads
                        measured[threads] = total / _timed(threads, make(threads))
                    rates[(kind, 1)].append(measured[1])
                    rates[(kind, n)].append(measured[n])
                    scalings[(kind, n)].append(measured[n] / measured[1])

    print(f"calls per block:   {args.calls} (over all threads); rounds: {args.rounds}")
    mode = "off" if ledger is None else ("on" if ledger.durable else "on, durable=False")
    print(f"attributes/span:   {n_attributes}; ledger: {mode}")
    print(
        "scaling: median over rounds of (rate at n threads / rate at 1 thread, measured next to it)"
    )
    print(f"{'threads':>8} {'captured/s':>12} {'scaling':>8} {'bare/s':>12} {'scaling':>8}")
    worst = 1.0
    for n in THREADS:
        c = statistics.median(rates[("captured", n)])
        b = statistics.median(rates[("bare", n)])
        cs = statistics.median(scalings[("captured", n)]) if n > 1 else 1.0
        bs = statistics.median(scalings[("bare", n)]) if n > 1 else 1.0
        worst = min(worst, cs)
        print(f"{n:>8} {c:>12,.0f} {cs:>8.2f} {b:>12,.0f} {bs:>8.2f}")
    print(f"worst captured scaling: {worst:.2f}  (target >= 0.8)")
    if ledger is not None:
        ledger.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
