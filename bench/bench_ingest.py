"""The OTLP ingest against the direct exporter, and the ingest's memory under large requests.

Runs an embedded PostgreSQL in a temporary directory (deleted afterwards) and the ingest as its
own process (``otel-agentcap ingest``), as it runs in production.

1. Throughput: the same captured spans (memory writes of 16 agents, ~600-byte payloads) are
   stored by ``PostgresSpanExporter.export`` in batches of ``--batch`` spans, and sent to the
   ingest as OTLP/HTTP protobuf requests of the same batches (encoded before the clock starts,
   as a collector holds them), one request at a time and then from ``--senders`` connections
   at once. Rounds alternate on a freshly truncated log; medians are reported, and the ratio
   ingest / exporter (target: at least 0.8).
2. Memory: the peak resident set (VmHWM) of the ingest process while ``--requests`` requests of
   ``--request-mib`` MiB each arrive at once: half are protobuf requests of small spans, half
   gzip bombs that inflate past the limit; the baseline is the process's peak before them.

    .venv/bin/python bench/bench_ingest.py [--spans 60000] [--batch 2000] [--rounds 3]
        [--senders 4] [--requests 8] [--request-mib 64] [--ingest-pythonpath DIR]

``--ingest-pythonpath`` runs the ingest process from another source tree (e.g. an earlier
version), to compare memory figures on the same machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import gzip
import http.client
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.trace.v1 import trace_pb2

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.migrate import migrate

AGENTS = 16


def make_spans(total: int) -> list[object]:
    """Real SDK spans from captured memory writes of 16 agents (~600-byte payloads each)."""
    import otel_agentcap as ac
    from otel_agentcap.testing import capture_events

    memory = ac.Memory("bench")
    with capture_events() as captured, ac.run("bench-ingest"):
        for agent in range(AGENTS):
            with ac.agent(f"agent-{agent:02d}"):
                for i in range(total // AGENTS):
                    memory[f"k{agent}-{i % 50}"] = {"note": f"finding {i} " + "x" * 260}
    return [s for s in captured.spans if s.name == "memory_write"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE agentcap.events, agentcap.agents, agentcap.runs, agentcap.conflicts,"
            " agentcap.record_conflicts"
        )
        conn.execute("CHECKPOINT")


def stored(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM agentcap.events").fetchone()
    return int(row[0]) if row else 0


class Ingest:
    """``otel-agentcap ingest`` in a process of its own."""

    def __init__(self, dsn: str, pythonpath: str | None, *extra: str) -> None:
        self.port = free_port()
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "otel_agentcap.cli",
                "ingest",
                "--dsn",
                dsn,
                "--port",
                str(self.port),
                *extra,
            ],
            env=env,
            cwd=tempfile.gettempdir(),  # not the source tree: -m would import from it first
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the ingest did not start")

    def status(self, field: str) -> int:
        """A memory figure of the process, in MiB (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
        return 0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def post(port: int, body: bytes, headers: dict[str, str] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(
            "POST",
            "/v1/traces",
            body=body,
            headers={"Content-Type": "application/x-protobuf", **(headers or {})},
        )
        response = conn.getresponse()
        response.read()
        return int(response.status)
    except OSError:
        return 0  # the server closed the connection before reading it all (413)
    finally:
        conn.close()


def run_exporter(dsn: str, spans: list[object], batch: int) -> float:
    from otel_agentcap.exporters.postgres import PostgresSpanExporter

    exporter = PostgresSpanExporter(dsn)
    exporter.export([])
    t0 = time.perf_counter()
    for start in range(0, len(spans), batch):
        exporter.export(spans[start : start + batch])  # type: ignore[arg-type]
    elapsed = time.perf_counter() - t0
    inserted = exporter.stats().events_inserted
    exporter.shutdown()
    return inserted / elapsed


def run_ingest(dsn: str, port: int, bodies: list[bytes], senders: int) -> float:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(senders) as pool:
        statuses = list(pool.map(lambda body: post(port, body), bodies))
    elapsed = time.perf_counter() - t0
    assert set(statuses) == {200}, statuses
    return stored(dsn) / elapsed


def small_spans_request(size: int) -> bytes:
    """A protobuf request of about ``size`` bytes of small spans without agentcap attributes."""
    span = trace_pb2.Span(
        trace_id=b"\1" * 16, span_id=b"\2" * 8, name="GET /", start_time_unix_nano=1
    ).SerializeToString()
    framed = b"\x12" + bytes([len(span)]) + span
    spans = framed * (size // len(framed))
    scope = b"\x12" + _varint(len(spans)) + spans
    return b"\x0a" + _varint(len(scope)) + scope


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def memory_under_load(dsn: str, args: argparse.Namespace) -> None:
    size = args.request_mib * 1024 * 1024 - 4096
    plain = small_spans_request(size)
    bomb = gzip.compress(b"\0" * (size + 2 * 1024 * 1024))
    ingest = Ingest(dsn, args.ingest_pythonpath)
    try:
        time.sleep(1)
        before = ingest.status("VmHWM")
        bodies = [(plain, {}), (bomb, {"Content-Encoding": "gzip"})] * (args.requests // 2)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            statuses = list(pool.map(lambda b: post(ingest.port, b[0], b[1]), bodies))
        elapsed = time.perf_counter() - t0
        peak = ingest.status("VmHWM")
    finally:
        ingest.close()
    print(
        f"memory: {len(bodies)} concurrent requests of {args.request_mib} MiB"
        f" ({args.requests // 2} protobuf of {len(plain) // 1024 // 1024} MiB, "
        f"{args.requests // 2} gzip bombs of {len(bomb) // 1024} KiB inflating past the limit)"
    )
    print(f"  answers: {sorted(statuses)} in {elapsed:.1f} s")
    print(f"  ingest peak RSS: {peak} MiB (before the requests: {before} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--request-mib", type=int, default=64)
    parser.add_argument("--ingest-pythonpath")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="agentcap-bench-ingest-"))
    try:
        dsn = embedded.start(root / "pg")
        migrate(dsn)
        if not args.skip_throughput:
            spans = make_spans(args.spans)
            bodies = [
                encode_spans(spans[i : i + args.batch]).SerializeToString()  # type: ignore[arg-type]
                for i in range(0, len(spans), args.batch)
            ]
            gc.collect()
            gc.freeze()
            ingest = Ingest(dsn, args.ingest_pythonpath)
            exporter_rates: list[float] = []
            serial_rates: list[float] = []
            parallel_rates: list[float] = []
            try:
                for _ in range(args.rounds):
                    reset(dsn)
                    exporter_rates.append(run_exporter(dsn, spans, args.batch))
                    reset(dsn)
                    serial_rates.append(run_ingest(dsn, ingest.port, bodies, 1))
                    reset(dsn)
                    parallel_rates.append(run_ingest(dsn, ingest.port, bodies, args.senders))
            finally:
                ingest.close()
            exporter = statistics.median(exporter_rates)
            serial = statistics.median(serial_rates)
            parallel = statistics.median(parallel_rates)
            print(f"spans={len(spans)} batch={args.batch} agents={AGENTS} rounds={args.rounds}")
            print(
                f"PostgresSpanExporter.export:  {exporter:>9,.0f} spans/s  {[round(r) for r in exporter_rates]}"
            )
            print(
                f"ingest, 1 sender:             {serial:>9,.0f} spans/s  {[round(r) for r in serial_rates]}"
            )
            print(
                f"ingest, {args.senders} senders:            {parallel:>9,.0f} spans/s  {[round(r) for r in parallel_rates]}"
            )
            print(f"ratio ingest (1 sender) / exporter:   {serial / exporter:.2f}  (target >= 0.8)")
            print(f"ratio ingest ({args.senders} senders) / exporter:  {parallel / exporter:.2f}")
        if not args.skip_memory:
            memory_under_load(dsn, args)
    finally:
        embedded.destroy(root / "pg")


if __name__ == "__main__":
    main()
