"""Helpers of the durable queue's fault tests: a PostgreSQL the test can stop and start, the
worker process, and queries over what the log holds."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.migrate import migrate

WORKER = Path(__file__).parent / "data" / "durable_worker.py"


@dataclass
class Server:
    """An embedded PostgreSQL of the test's own, which the test may stop and start."""

    data_dir: Path
    admin_dsn: str

    def new_database(self) -> str:
        name = f"agentcap_fault_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        dsn = embedded.dsn_for(self.admin_dsn, name)
        migrate(dsn)
        return dsn

    def stop(self) -> None:
        embedded.stop(self.data_dir)

    def start(self) -> None:
        embedded.start(self.data_dir, database="postgres")


@contextmanager
def restartable_server() -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="agentcap-fault-pg-"))
    data_dir = root / "pg"
    try:
        yield Server(data_dir, embedded.start(data_dir, database="postgres"))
    finally:
        embedded.destroy(data_dir)
        shutil.rmtree(root, ignore_errors=True)


def start_worker(
    dsn: str,
    run_id: str,
    name: str,
    *,
    ops: int,
    queue_dir: Path,
    rate: float = 0.0,
    counter: Path | None = None,
    shutdown_timeout: float = 30.0,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        str(WORKER),
        dsn,
        run_id,
        name,
        "--ops",
        str(ops),
        "--queue-dir",
        str(queue_dir),
        "--shutdown-timeout",
        str(shutdown_timeout),
    ]
    if rate:
        command += ["--rate", str(rate)]
    if counter is not None:
        command += ["--counter", str(counter)]
    command += list(extra)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[dict[str, Any], str]:
    """Wait for a worker; its JSON result and its stderr. Fails on a non-zero exit."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def read_counter(path: Path) -> tuple[int, int]:
    """(operations, events) the worker had captured when it last wrote its counter."""
    data = path.read_bytes()
    if len(data) < 16:
        return 0, 0
    ops, events = struct.unpack("<QQ", data[:16])
    return int(ops), int(events)


def wait_for_counter(path: Path, at_least: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and read_counter(path)[0] >= at_least:
            return
        time.sleep(0.02)
    raise AssertionError(f"worker did not reach {at_least} operations")


def scalar(dsn: str, sql: str, *params: object) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def log_summary(dsn: str, run_id: str) -> dict[str, int]:
    """Events of the run, distinct (agent, seq) pairs, conflicts, and causal parents that name
    no stored event (dangling)."""
    with psycopg.connect(dsn) as conn:
        events, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT (agent_id, logical_seq)) FROM agentcap.events "
            "WHERE run_id = %s",
            (run_id,),
        ).fetchone() or (0, 0)
        conflicts = conn.execute(
            "SELECT count(*) FROM agentcap.conflicts WHERE run_id = %s", (run_id,)
        ).fetchone()
        dangling = conn.execute(
            "SELECT count(*) FROM agentcap.events e, unnest(e.causal_parent_ids) p "
            "WHERE e.run_id = %s AND NOT EXISTS "
            "(SELECT 1 FROM agentcap.events x WHERE x.event_id = p)",
            (run_id,),
        ).fetchone()
    return {
        "events": int(events),
        "distinct_seqs": int(distinct),
        "conflicts": int(conflicts[0]) if conflicts else 0,
        "dangling": int(dangling[0]) if dangling else 0,
    }


_REFUSED_THEN_RESTORED = textwrap.dedent(
    """
    import json, sys
    import psycopg
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, admin_dsn, queue_dir, run_id, refuse, restore = sys.argv[1:7]

    def as_admin(statement):
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute("SET default_transaction_read_only = off")
            conn.execute(statement)

    agentcap = configure(dsn, queue_dir=queue_dir, announce=False, instrument=False)
    if refuse:
        as_admin(refuse)
    with ac.run(run_id), ac.agent("a"):
        for j in range(5):
            ac.Memory("m")[f"k{j}"] = j
    first = agentcap.force_flush(timeout=3)  # cannot succeed while writes are refused
    refused_then = agentcap.stats().spans_refused
    as_admin(restore)
    second = agentcap.force_flush(timeout=120)
    stats = agentcap.stats()
    agentcap.shutdown(timeout=10)
    print(json.dumps({"first": first, "refused_then": refused_then, "second": second,
                      "refused": stats.spans_refused, "retried": stats.failed_attempts}))
    """
)


def refused_then_restored(
    dsn: str, admin_dsn: str, queue_dir: Path, run_id: str, restore: str, refuse: str = ""
) -> dict[str, Any]:
    """In a process configured on ``dsn``: run ``refuse`` as ``admin_dsn`` (unless writes are
    refused already), capture a run of 7 events, flush (it cannot succeed), run ``restore`` as
    ``admin_dsn``, flush again; what the two flushes returned and the exporter's figures."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _REFUSED_THEN_RESTORED,
            dsn,
            admin_dsn,
            str(queue_dir),
            run_id,
            refuse,
            restore,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
