"""Peak memory of ``otel-agentcap export`` and ``import`` of one big run, per event.

Writes one run of about ``--events`` events (the shape of ``bench_pg_scale.py``'s runs: a planner
spawning workers that call a model and run tools, payloads of 100 to 1,500 bytes, a span envelope
per operation) through the real writer into an embedded PostgreSQL in a temporary directory (or
``--dsn``), then runs, each in a process of its own, ``export --format FORMAT -o FILE`` for each
format and ``import FILE`` of the agentcap-pb file into an empty database, and prints each one's
peak resident set size (``ru_maxrss`` of the child), its bytes per event, the size of the file,
and whether exporting the imported run gives the same bytes.

    .venv/bin/python bench/bench_transfer.py [--events 50000 200000] [--formats agentcap-pb]
        [--dsn DSN] [--keep]

Not a test: a 200,000-event run takes minutes to write.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).parent))

from bench_pg_scale import make_run

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.database import Database
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import Batch, RunRecord

T0 = datetime(2025, 1, 6, tzinfo=UTC)


def _database(server_dsn: str, name: str) -> str:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = embedded.dsn_for(server_dsn, name)
    migrate(dsn)
    return dsn


def write_run(dsn: str, run_id: str, events: int) -> int:
    """A run of about ``events`` events in the log of ``dsn``; returns how many it has."""
    steps = 333  # 1,001 events a worker
    run = make_run(run_id, T0, random.Random(1), workers=max(1, events // 1001), steps=steps)
    database = Database(dsn)
    writer = EventWriter(database.pool)
    try:
        head = Batch(
            tuple(run.events[:2000]),
            tuple(run.agents),
            runs=(RunRecord(run_id, T0),),
            spans=tuple(run.spans),
        )
        writer.write(head)
        for start in range(2000, len(run.events), 2000):
            writer.write(Batch(tuple(run.events[start : start + 2000])))
    finally:
        writer.close()
        database.close()
    return len(run.events)


def _child_peak(*args: str) -> tuple[int, float]:
    """Peak RSS of one command run in a fresh process of its own (so that ru_maxrss is its own)."""
    code = (
        "import resource, subprocess, sys, time\n"
        "t = time.monotonic()\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True)\n"
        "t = time.monotonic() - t\n"
        "sys.stderr.write(done.stderr.decode())\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, t, done.returncode)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, sys.executable, "-m", "otel_agentcap.cli", *args],
        capture_output=True,
        check=True,
    )
    peak, seconds, status = done.stdout.split()
    if int(status) != 0:
        raise SystemExit(f"{args[0]} failed: {done.stderr.decode()}")
    return int(peak) * 1024, float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[50_000, 200_000])
    parser.add_argument("--formats", nargs="+", default=["agentcap-pb", "otlp-json", "jaeger-json"])
    parser.add_argument("--dsn", help="a server to create databases in (default: embedded)")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="agentcap-transfer-"))
    server = args.dsn or embedded.dsn_for(embedded.start(root / "pg"), "postgres")
    try:
        for size in args.events:
            source = _database(server, "agentcap_transfer_source")
            target = _database(server, "agentcap_transfer_target")
            run_id = f"big-{size}"
            count = write_run(source, run_id, size)
            print(f"run {run_id}: {count:,} events")
            for fmt in args.formats:
                path = root / f"{run_id}.{fmt}"
                peak, seconds = _child_peak(
                    "export", run_id, "--dsn", source, "--format", fmt, "-o", str(path)
                )
                print(
                    f"  export {fmt:<12} peak RSS {peak / 2**20:8.1f} MiB  "
                    f"{peak / count:8.0f} B/event  {seconds:6.1f} s  "
                    f"file {path.stat().st_size / 2**20:8.1f} MiB"
                )
            path = root / f"{run_id}.agentcap-pb"
            if path.exists():
                peak, seconds = _child_peak("import", str(path), "--dsn", target, "--json")
                print(
                    f"  import agentcap-pb   peak RSS {peak / 2**20:8.1f} MiB  "
                    f"{peak / count:8.0f} B/event  {seconds:6.1f} s"
                )
                again = root / "again.pb"
                _child_peak(
                    "export", run_id, "--dsn", target, "--format", "agentcap-pb", "-o", str(again)
                )
                same = again.read_bytes() == path.read_bytes()
                print(f"  round trip byte-identical: {same}")
            for fmt in args.formats:
                (root / f"{run_id}.{fmt}").unlink(missing_ok=True)
    finally:
        if not args.keep and not args.dsn:
            embedded.stop(root / "pg")
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")


if __name__ == "__main__":
    main()
