"""Cost of a ledger-protected tool call against an unprotected captured one, and the database round
trips a protected call costs.

Both kinds are ``tool.invoke(new id, ...)`` inside an agent, through a TracerProvider with
AgentCapSpanProcessor and a SimpleSpanProcessor to an exporter that drops everything; the protected
kind also claims and completes the call in ``agentcap.tool_ledger`` (PostgresToolLedger). Calls of
the two kinds alternate, one by one, and each call's wall time is recorded; the medians and 99th
percentiles are printed.

Round trips are counted on the wire: the ledger's connections go through a proxy in this process
that counts every turn of the conversation (the client sending after it last received), during the
protected calls only (the pool is warmed up first). The ledger's own count of statements is printed
next to it. The lease is long enough that no renewal falls inside the measurement.

Two ledgers are measured in turn: the default one, whose statements commit durably (each waits for
the WAL flush, so a protected call costs two flushes of the server's disk), and one with
``durable=False`` (commits do not wait for the flush).

The database is an embedded PostgreSQL in a temporary directory, or ``--dsn`` (a database this
benchmark may migrate and write to).

    .venv/bin/python bench/bench_ledger.py [--calls 2000] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import itertools
import os
import select
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import otel_agentcap as oa
from otel_agentcap.capture.ledger import set_tool_ledger
from otel_agentcap.exporters.postgres import Database, embedded, migrate
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor


class DropExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class TurnCountingProxy:
    """Forwards connections to a PostgreSQL server (Unix socket or TCP) and counts the turns of
    every conversation: each time a client sends after it last received is one round trip."""

    def __init__(self, dsn: str) -> None:
        params = conninfo_to_dict(dsn)
        host = str(params.get("host") or "localhost")
        port = int(params.get("port") or 5432)
        self._unix = host.startswith("/")
        if self._unix:
            self._upstream: str | tuple[str, int] = os.path.join(host, f".s.PGSQL.{port}")
            self._dir = tempfile.mkdtemp(prefix="agentcap-proxy-")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(os.path.join(self._dir, f".s.PGSQL.{port}"))
            self.dsn = make_conninfo(dsn, host=self._dir)
        else:
            self._upstream = (host, port)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            self.dsn = make_conninfo(dsn, host="127.0.0.1", port=listener.getsockname()[1])
        listener.listen(64)
        self._listener = listener
        self._lock = threading.Lock()
        self.turns = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            family = socket.AF_UNIX if self._unix else socket.AF_INET
            server = socket.socket(family, socket.SOCK_STREAM)
            server.connect(self._upstream)
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        last_from_client = False
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [])
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        if not last_from_client:
                            with self._lock:
                                self.turns += 1
                        last_from_client = True
                        server.sendall(data)
                    else:
                        last_from_client = False
                        client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000, help="calls of each kind")
    parser.add_argument("--dsn", help="a database to use instead of an embedded one")
    args = parser.parse_args()

    data_dir: Path | None = None
    if args.dsn:
        dsn = args.dsn
    else:
        data_dir = Path(tempfile.mkdtemp(prefix="agentcap-bench-")) / "pg"
        dsn = embedded.start(data_dir, database="postgres")
    try:
        migrate(dsn)
        _install_provider()
        for durable in (True, False):
            proxy = TurnCountingProxy(dsn)
            database = Database(proxy.dsn)
            ledger = PostgresToolLedger(database, lease=3600.0, durable=durable)
            print(f"-- ledger with durable={durable}")
            run(args.calls, ledger, proxy)
            ledger.close()
            database.close()
    finally:
        if data_dir is not None:
            embedded.destroy(data_dir)


def _install_provider() -> None:
    provider = TracerProvider()
    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(DropExporter()))
    trace.set_tracer_provider(provider)


def run(calls: int, ledger: PostgresToolLedger, proxy: TurnCountingProxy) -> None:
    @oa.tool
    def lookup(city: str, days: int = 3) -> dict[str, object]:
        return {"city": city, "forecast": ["sun"] * days}

    counter = itertools.count()
    protected: list[float] = []
    unprotected: list[float] = []
    run_id = f"bench-ledger-{time.time_ns()}"
    with oa.run(run_id), oa.agent("bench-agent"):
        set_tool_ledger(ledger)
        for _ in range(200):  # warm up, connections included
            lookup.invoke(f"warm-{next(counter)}", "Oslo", days=2)
        turns_before = proxy.turns
        statements_before = ledger.stats().round_trips
        for _ in range(calls):
            set_tool_ledger(ledger)
            start = time.perf_counter()
            lookup.invoke(f"p-{next(counter)}", "Oslo", days=2)
            protected.append(time.perf_counter() - start)
            set_tool_ledger(None)
            start = time.perf_counter()
            lookup.invoke(f"u-{next(counter)}", "Oslo", days=2)
            unprotected.append(time.perf_counter() - start)
        turns = proxy.turns - turns_before
        statements = ledger.stats().round_trips - statements_before
    set_tool_ledger(None)

    def us(value: float) -> str:
        return f"{value * 1e6:9.1f} us"

    print(f"calls of each kind:              {calls} (alternating)")
    print(
        f"unprotected captured call:       median {us(statistics.median(unprotected))}, "
        f"p99 {us(_percentile(unprotected, 0.99))}"
    )
    print(
        f"ledger-protected captured call:  median {us(statistics.median(protected))}, "
        f"p99 {us(_percentile(protected, 0.99))}"
    )
    print(
        f"protected / unprotected:         median "
        f"{statistics.median(protected) / statistics.median(unprotected):.1f}x"
    )
    print(
        f"round trips per protected call:  {turns / calls:.2f} on the wire, "
        f"{statements / calls:.2f} statements (target <= 2)"
    )


if __name__ == "__main__":
    main()
