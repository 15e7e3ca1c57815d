"""Time of migration 0006 (run-leading keys, partitions by run start) on a log written before it.

Builds the schema of migrations 0001 to 0005 in an embedded PostgreSQL (temporary directory,
deleted afterwards), fills it with ``--events`` events in runs of 150 (five agents each, one
causal parent per event, ~600-byte payloads, a response id on every fourth event, as model calls
have) plus their runs, agents and span envelopes (one per agent and a root span per run), a tool
ledger row and a memory key per run, then times ``migrate()``, which copies events, conflicts
and spans into the partitioned tables and builds their keys. Those tables and runs are locked
(ACCESS EXCLUSIVE) for that whole time; meanwhile another session tries to read every table of
the schema, each with a 200 ms lock timeout, and the tables it could not read are printed.

    .venv/bin/python bench/bench_pg_migrate.py [--events 1000000 3000000] [--days 120]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Final

import psycopg

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.migrate import available_migrations, migrate

_SEED = """
INSERT INTO agentcap.events (event_id, run_id, agent_id, logical_seq, wall_time, event_type,
    causal_parent_ids, idempotency_key, trace_id, span_id, payload)
SELECT md5('e' || i)::uuid,
       'run-' || (i / 150),
       'agent-' || (i %% 5),
       i / 5,
       %(t0)s::timestamptz + (i / 150) * %(gap)s::interval + (i %% 150) * interval '1 second',
       CASE WHEN i %% 4 = 0 THEN 'model_call' ELSE 'tool_result' END,
       CASE WHEN i %% 150 = 0 THEN '{}'::uuid[] ELSE ARRAY[md5('e' || (i - 1))::uuid] END,
       'seq:' || (i / 5),
       md5('t' || (i / 150)),
       substr(md5('s' || i), 1, 16),
       jsonb_build_object('text', repeat(md5(i::text), 17))
         || CASE WHEN i %% 4 = 0 THEN jsonb_build_object('response_id', 'msg_' || i)
                 ELSE '{}'::jsonb END
FROM generate_series(%(lo)s, %(hi)s - 1) AS i
"""


_SPANS: Final = """
INSERT INTO agentcap.spans (run_id, trace_id, span_id, parent_span_id, name, start_time, end_time)
SELECT run_id, md5(run_id), substr(md5(run_id || agent_id), 1, 16), substr(md5(run_id), 1, 16),
       'invoke_agent ' || agent_id, min(wall_time), max(wall_time)
FROM agentcap.events GROUP BY run_id, agent_id
UNION ALL
SELECT run_id, md5(run_id), substr(md5(run_id), 1, 16), NULL, 'invoke_workflow ' || run_id,
       min(wall_time), max(wall_time)
FROM agentcap.events GROUP BY run_id
"""


def build_version_5(dsn: str, events: int, days: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS agentcap CASCADE")
        conn.execute("CREATE SCHEMA agentcap")
        conn.execute(
            "CREATE TABLE agentcap.schema_version (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for migration in available_migrations()[:5]:
            conn.execute(migration.sql_text.encode())
            conn.execute(
                "INSERT INTO agentcap.schema_version VALUES (%s, %s)",
                (migration.version, migration.name),
            )
        runs = events // 150
        gap = f"{days * 86400 / max(runs, 1):.3f} seconds"
        step = 500_000
        for lo in range(0, events, step):
            conn.execute(
                _SEED, {"t0": "2025-01-01", "gap": gap, "lo": lo, "hi": min(events, lo + step)}
            )
        conn.execute(
            "INSERT INTO agentcap.runs (run_id, started_at)"
            " SELECT run_id, min(wall_time) FROM agentcap.events GROUP BY 1"
        )
        conn.execute(
            "INSERT INTO agentcap.agents (run_id, agent_id)"
            " SELECT DISTINCT run_id, agent_id FROM agentcap.events"
        )
        conn.execute(_SPANS)
        conn.execute(
            "INSERT INTO agentcap.tool_ledger (run_id, agent_id, invocation_id, call_digest, tool,"
            " ordinal, status, result) SELECT run_id, 'agent-0', 'call-1', md5(run_id), 'search',"
            " 0, 'succeeded', '{\"hits\": 3}' FROM agentcap.runs"
        )
        conn.execute(
            "INSERT INTO agentcap.memory (run_id, memory, key, found, value, version)"
            " SELECT run_id, 'notes', 'plan', true, '[\"a\", \"b\"]', 1 FROM agentcap.runs"
        )
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")


def _probe(dsn: str, stop: threading.Event, blocked: set[str]) -> None:
    """Until ``stop``: read one row of every table of the schema with a 200 ms lock timeout;
    collect the tables that timed out."""
    time.sleep(0.5)  # the migration has taken its locks
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '200ms'")
        tables = [
            str(r[0])
            for r in conn.execute(
                "SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'agentcap'::regnamespace"
                " AND c.relkind IN ('r', 'p') AND NOT c.relispartition ORDER BY 1"
            )
        ]
        while not stop.is_set():
            for table in tables:
                try:
                    conn.execute(f"SELECT 1 FROM agentcap.{table} LIMIT 1")
                except psycopg.errors.LockNotAvailable:
                    blocked.add(table)
                except psycopg.Error:
                    pass  # renamed or dropped by the migration
            stop.wait(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--days", type=int, default=120, help="span of the runs' starts")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="agentcap-migrate-"))
    try:
        dsn = embedded.start(root / "pg")
        print(f"load average at start: {os.getloadavg()}, cpus: {os.cpu_count()}")
        for events in args.events:
            build_version_5(dsn, events, args.days)
            with psycopg.connect(dsn, autocommit=True) as conn:
                size = conn.execute("SELECT pg_total_relation_size('agentcap.events')").fetchone()[
                    0
                ]  # type: ignore[index]
            stop = threading.Event()
            blocked: set[str] = set()
            prober = threading.Thread(target=_probe, args=(dsn, stop, blocked), daemon=True)
            started = time.perf_counter()
            prober.start()
            applied = migrate(dsn)
            seconds = time.perf_counter() - started
            stop.set()
            prober.join()
            with psycopg.connect(dsn, autocommit=True) as conn:
                after = conn.execute(
                    "SELECT count(*), count(DISTINCT tableoid) FROM agentcap.events"
                ).fetchone()
            assert applied == [6] and after is not None and after[0] == events
            print(
                f"{events:,} events ({size / 1e9:.2f} GB with indexes) in {after[1]} partitions:"
                f" migrate {applied} took {seconds:.1f} s, {seconds / events * 1e6:.1f} s per"
                f" million events (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            print(f"  tables another session could not read meanwhile: {sorted(blocked)}")
    finally:
        embedded.destroy(root / "pg")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
