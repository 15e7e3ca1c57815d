"""The durable queue under faults, with real processes and a real PostgreSQL: a killed process,
a database restarted under load, a shutdown while it is down, a torn queue, a disk that refuses
writes, a database that hangs. Nothing captured is lost, nothing is stored twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from durable_support import (
    Server,
    finish,
    log_summary,
    read_counter,
    refused_then_restored,
    restartable_server,
    start_worker,
    wait_for_counter,
)

from otel_agentcap.exporters.durable.frames import ScanResult
from otel_agentcap.exporters.durable.records import decode_span
from otel_agentcap.exporters.durable.segments import (
    AckFile,
    Position,
    SegmentReader,
    segment_indexes,
    segment_path,
)

pytestmark = [pytest.mark.storage, pytest.mark.fault, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A PostgreSQL of this module's own, which tests stop and start."""
    with restartable_server() as started:
        yield started


def _queues(queue_dir: Path) -> list[Path]:
    return [p for p in queue_dir.glob("*/p-*") if p.is_dir()]


def _kill_mid_batch(pg_dsn: str, run_id: str, queue_dir: Path, tmp_path: Path) -> int:
    """Start a worker, SIGKILL it while it captures and delivers; the events it handed over."""
    counter = tmp_path / f"{run_id}.counter"
    proc = start_worker(pg_dsn, run_id, "a", ops=200_000, queue_dir=queue_dir, counter=counter)
    wait_for_counter(counter, 3000 + random.randrange(2000))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    _, events = read_counter(counter)
    return events


def test_sigkill_mid_batch_then_restart_loses_nothing_and_doubles_nothing(pg_dsn, tmp_path):
    """A process killed with SIGKILL while it captures and delivers: the next process on the same
    queue directory delivers what it left; every event whose operation returned is stored, once."""
    queue_dir = tmp_path / "queue"
    handed_over = _kill_mid_batch(pg_dsn, "run-kill", queue_dir, tmp_path)
    assert _queues(queue_dir), "the killed process left its queue"
    result, err = finish(start_worker(pg_dsn, "run-other", "b", ops=10, queue_dir=queue_dir))
    summary = log_summary(pg_dsn, "run-kill")
    # Every operation that returned is stored; one more may have ended its span before the
    # counter was written. Nothing is stored twice, nothing collided.
    assert handed_over <= summary["events"] <= handed_over + 2
    assert summary["distinct_seqs"] == summary["events"]
    assert summary["conflicts"] == 0
    assert summary["dangling"] == 0
    assert result["stats"]["spans_adopted"] > 0
    assert not _queues(queue_dir), "the adopted queue was removed once delivered"
    assert "Traceback" not in err


def _readable_span_ids(queue: Path, start: Position) -> tuple[set[str], ScanResult]:
    """The span ids of the records a reader finds in ``queue`` from ``start``, and its scan."""
    reader = SegmentReader(queue, start)
    found: set[str] = set()
    while batch := reader.read(1000, 1 << 24):
        found.update(f"{decode_span(r).context.span_id:016x}" for r in batch)
    reader.close()
    return found, reader.scan


def _stored_span_ids(dsn: str, run_id: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT DISTINCT span_id FROM agentcap.events WHERE run_id = %s", (run_id,)
        )
        return {row[0] for row in rows}


def test_a_torn_queue_is_delivered_up_to_its_last_complete_record(pg_dsn, tmp_path):
    """A killed process's last segment cut inside a record (as a crash in the middle of a write
    leaves it): every complete record is delivered, the cut one is counted and logged."""
    queue_dir = tmp_path / "queue"
    _kill_mid_batch(pg_dsn, "run-torn", queue_dir, tmp_path)
    (queue,) = _queues(queue_dir)
    last = segment_path(queue, max(segment_indexes(queue)))
    size = last.stat().st_size
    os.truncate(last, size - random.randrange(1, min(size - 16, 400)))
    complete, scan = _readable_span_ids(queue, Position(0, 0))
    assert scan.torn > 0 and complete
    result, err = finish(start_worker(pg_dsn, "run-other", "b", ops=10, queue_dir=queue_dir))
    assert complete <= _stored_span_ids(pg_dsn, "run-torn")
    assert result["stats"]["bytes_corrupt"] > 0
    assert "bytes of a cut record" in err and "damaged records" not in err
    assert log_summary(pg_dsn, "run-torn")["conflicts"] == 0


@pytest.mark.parametrize("left", ["as_killed", "all_acknowledged"])
def test_records_damaged_before_the_end_are_skipped_counted_and_said_to_be_lost(
    pg_dsn, tmp_path, left
):
    """Bytes changed in the middle of a killed process's segment (a lost block, not a cut), its
    acknowledgement rewound to the queue's start so the damage is among records to deliver
    whatever the kill's timing (also when it had acknowledged every record): every intact
    record before and after them is delivered; the damage is counted and logged as damage, with
    its spans lost, not as a crash while writing."""
    queue_dir = tmp_path / "queue"
    _kill_mid_batch(pg_dsn, "run-damaged", queue_dir, tmp_path)
    (queue,) = _queues(queue_dir)
    if left == "all_acknowledged":  # what a kill just after a delivery leaves
        newest = max(segment_indexes(queue))
        AckFile(queue).store(Position(newest, segment_path(queue, newest).stat().st_size))
    # Whatever the killed process had acknowledged when it died (all of it, or nothing), every
    # record of its queue is read again from the start of its oldest segment (the log stores
    # each once): the damage lands among records still to deliver, not in what a reader skips.
    oldest = min(segment_indexes(queue))
    acked = Position(oldest, 0)
    AckFile(queue).store(acked)
    path = segment_path(queue, oldest)
    middle = path.stat().st_size // 2
    with open(path, "r+b") as file:
        file.seek(middle)
        block = file.read(64)
        file.seek(middle)
        file.write(bytes(b ^ 0xFF for b in block))
    intact, scan = _readable_span_ids(queue, acked)
    assert scan.skipped > 0 and intact
    result, err = finish(start_worker(pg_dsn, "run-other", "b", ops=10, queue_dir=queue_dir))
    assert intact <= _stored_span_ids(pg_dsn, "run-damaged")
    assert result["stats"]["bytes_corrupt"] >= scan.skipped
    assert "damaged records before its end" in err and "are lost" in err
    assert log_summary(pg_dsn, "run-damaged")["conflicts"] == 0


def test_postgres_restart_under_load_from_two_processes(server, tmp_path):
    """Two processes capture for one shared agent at a steady rate while PostgreSQL is stopped
    for several seconds and started again: every captured event is stored once, no sequence is
    handed out twice, no causal parent dangles, and the outage is logged once per change."""
    dsn = server.new_database()
    queue_dir = tmp_path / "queue"
    workers = [
        start_worker(dsn, "run-restart", name, ops=9000, rate=1000, queue_dir=queue_dir)
        for name in ("p1", "p2")
    ]
    time.sleep(2.5)
    server.stop()
    time.sleep(4)
    server.start()
    results = [finish(w) for w in workers]
    captured = sum(r["events"] for r, _ in results)
    summary = log_summary(dsn, "run-restart")
    assert summary == {
        "events": captured,
        "distinct_seqs": captured,
        "conflicts": 0,
        "dangling": 0,
    }
    for result, err in results:
        assert result["stats"]["events_dropped"] == 0
        assert result["stats"]["spans_left"] == 0
        assert "Traceback" not in err
        assert err.count("agentcap: PostgreSQL") <= 4, err


def test_shutdown_while_postgres_is_down_then_a_later_process_delivers(server, tmp_path):
    """Shut down while the database is down: shutdown returns within its timeout, reports what it
    left in one line, and a later process with the database up delivers all of it."""
    dsn = server.new_database()
    queue_dir = tmp_path / "queue"
    server.stop()
    try:
        result, err = finish(
            start_worker(dsn, "run-down", "a", ops=600, queue_dir=queue_dir, shutdown_timeout=2)
        )
    finally:
        server.start()
    assert result["shutdown_s"] < 4
    assert result["stats"]["spans_left"] > 0
    assert err.count("not yet stored") == 1
    assert "Traceback" not in err
    later, _ = finish(start_worker(dsn, "run-later", "b", ops=3, queue_dir=queue_dir))
    summary = log_summary(dsn, "run-down")
    assert summary["events"] == result["events"]
    assert summary["conflicts"] == summary["dangling"] == 0
    assert later["stats"]["spans_adopted"] >= result["stats"]["spans_left"]


def test_a_directory_that_cannot_be_created_falls_back_to_memory(pg_dsn, tmp_path):
    """A queue directory that cannot be created: one clear line, a counter, and the program runs
    on with its events delivered from memory."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result, err = finish(
        start_worker(pg_dsn, "run-nodir", "a", ops=300, queue_dir=blocker / "queue")
    )
    assert result["stats"]["disk_errors"] >= 1
    assert result["stats"]["spans_in_memory"] > 0
    assert err.count("agentcap: disk queue") == 1, err
    assert log_summary(pg_dsn, "run-nodir")["events"] == result["events"]


def test_a_disk_that_fills_up_falls_back_to_memory(pg_dsn, tmp_path):
    """Writes that start failing mid-run (the file size limit stands in for a full disk): one
    clear line, a counter, and every event is still stored."""
    result, err = finish(
        start_worker(
            pg_dsn,
            "run-full",
            "a",
            ops=3000,
            queue_dir=tmp_path / "queue",
            extra=("--fsize-limit", str(256 * 1024)),
        )
    )
    assert result["stats"]["disk_errors"] >= 1
    assert result["stats"]["spans_in_memory"] > 0
    assert err.count("agentcap: disk queue") <= 2, err
    assert "Traceback" not in err
    assert log_summary(pg_dsn, "run-full")["events"] == result["events"]


def test_a_database_that_hangs_does_not_hold_up_the_agent(pg_dsn, tmp_path):
    """While a transaction holds a lock every write and every sequence reservation waits on,
    capture goes on: at most two operations (entering the agent included) wait for a statement
    timeout (the capture path's 2 s), and none waits for the lock to go; once it goes, every
    event is stored. (Operations of a few hundred ms are the tool ledger's commits on a loaded
    disk, not the lock.)

    The tool ledger is not locked here: a tool call whose ledger row is locked waits for the
    lock by design (it never runs without the ledger; tests/test_pg_ledger.py). The bound on the
    slowest operation is half the time the lock is held, not the 2 s timeout plus a guess at
    scheduling delay: on CI's two loaded cores entering the agent took 3.3 s. An operation that
    waited for the lock would take the lock's whole time less the worker's start-up."""
    locker = psycopg.connect(pg_dsn)
    locker.execute("LOCK TABLE agentcap.events, agentcap.agent_sequences IN ACCESS EXCLUSIVE MODE")
    proc = start_worker(
        pg_dsn,
        "run-hang",
        "a",
        ops=6400,
        rate=800,
        queue_dir=tmp_path / "queue",
        extra=("--latencies",),
    )
    lock_held_s = 9.0
    time.sleep(lock_held_s)
    locker.rollback()
    locker.close()
    result, err = finish(proc)
    assert result["over_1s"] <= 2, result["slowest_ops"]
    assert max(result["slowest"]) < lock_held_s / 2, result["slowest_ops"]
    assert log_summary(pg_dsn, "run-hang")["events"] == result["events"]
    assert "Traceback" not in err


_FORKED_POOL = textwrap.dedent(
    """
    import json, multiprocessing, sys
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    dsn, queue_dir, run_id = sys.argv[1:4]
    agentcap = configure(dsn, queue_dir=queue_dir, announce=False)

    def task(i):
        with ac.run(run_id, resume=True), ac.agent(f"worker-{i}"):
            for j in range(5):
                ac.Memory("m")[f"k{i}-{j}"] = j
        return i

    if __name__ == "__main__":
        # Pool workers are forked; leaving the block terminates them (SIGTERM): what they queued
        # is on disk, in their own queues, and nothing of it is flushed by them.
        with multiprocessing.get_context("fork").Pool(2) as pool:
            pool.map(task, range(8))
        agentcap.shutdown(timeout=60)
        stats = agentcap.stats()
        print(json.dumps({"adopted": stats.spans_adopted, "left": stats.spans_left}))
    """
)


def test_forked_workers_queues_are_delivered_by_the_parents_shutdown(pg_dsn, tmp_path):
    """Workers forked after configure() write queues of their own; when they end without
    flushing (a pool terminated), the parent's shutdown looks for the queues they left and
    delivers them within its timeout, instead of leaving them for a later process."""
    run_id = "run-forked-pool"
    done = subprocess.run(
        [sys.executable, "-c", _FORKED_POOL, pg_dsn, str(tmp_path / "queue"), run_id],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["adopted"] > 0 and result["left"] == 0
    summary = log_summary(pg_dsn, run_id)
    assert summary["events"] == 8 * 7  # agent_start, 5 writes, agent_end for each worker
    assert summary["conflicts"] == summary["dangling"] == 0


def test_a_database_that_takes_no_writes_keeps_the_spans_queued(pg_dsn, tmp_path):
    """A database that is read-only (default_transaction_read_only, as a hot standby is) refuses
    every write, not the rows: the spans wait in the queue, none is set aside as refused, and
    once it takes writes again (new connections) every event is stored."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        database = conn.info.dbname
        conn.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
    result = refused_then_restored(
        pg_dsn,
        pg_dsn,
        tmp_path / "queue",
        "run-read-only",
        f'ALTER DATABASE "{database}" RESET default_transaction_read_only',
    )
    assert result["first"] is False and result["refused_then"] == 0
    assert result["second"] is True and result["refused"] == 0 and result["retried"] > 0
    summary = log_summary(pg_dsn, "run-read-only")
    assert summary["events"] == 7 and summary["conflicts"] == summary["dangling"] == 0
