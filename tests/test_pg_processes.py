"""Several processes serving one agent, restarts and spawn retries, through configure()."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psycopg
import pytest

pytestmark = [pytest.mark.storage, pytest.mark.multiprocess]

_WORKER = textwrap.dedent(
    """
    import sys
    import otel_agentcap as ac
    from otel_agentcap.configure import configure
    from otel_agentcap.clock import clocks

    dsn, run_id, mode, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    provider = configure(dsn, batch=True, announce=False)
    # Small blocks so the processes interleave their reservations many times.
    from otel_agentcap.exporters.postgres import Database, PostgresSequenceSource
    clocks.configure(PostgresSequenceSource(Database(dsn)), block_size=8)
    memory = ac.Memory("shared")
    with ac.run(run_id, resume=True):
        with ac.agent("worker") as worker:
            if mode == "spawn":
                child = worker.spawn("helper", key="h")
                child.run(lambda: memory.set("child", 1))
            for i in range(count):
                memory[f"k{i % 5}"] = i
    provider.shutdown()
    """
)


def _run_workers(dsn: str, run_id: str, mode: str, count: int, processes: int) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, dsn, run_id, mode, str(count)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err


def _rows(dsn: str, sql: str, *params: object) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


def test_two_processes_serving_one_agent_never_share_a_sequence(pg_dsn):
    """Concurrent processes capturing for the same (run, agent) store every event, no conflicts."""
    _run_workers(pg_dsn, "run-mp", "plain", 60, processes=3)
    counts = _rows(
        pg_dsn,
        "SELECT count(*), count(DISTINCT logical_seq) FROM agentcap.events "
        "WHERE run_id = 'run-mp' AND agent_id = 'worker'",
    )
    # Each process: agent_start, 60 writes, agent_end.
    assert counts == [(3 * 62, 3 * 62)]
    assert _rows(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == [(0,)]


def test_restarted_process_continues_above_stored_sequences(pg_dsn):
    """An agent resumed in a new process gets sequences above all its stored ones."""
    _run_workers(pg_dsn, "run-restart", "plain", 10, processes=1)
    (first_max,) = _rows(
        pg_dsn, "SELECT max(logical_seq) FROM agentcap.events WHERE run_id = 'run-restart'"
    )[0]
    _run_workers(pg_dsn, "run-restart", "plain", 10, processes=1)
    starts = _rows(
        pg_dsn,
        "SELECT logical_seq FROM agentcap.events WHERE run_id = 'run-restart' "
        "AND event_type = 'agent_start' ORDER BY logical_seq",
    )
    assert len(starts) == 2
    assert starts[1][0] > first_max
    assert _rows(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == [(0,)]


def test_spawn_retried_in_a_new_process_returns_the_same_child(pg_dsn):
    """A second process spawning the same key gets the stored child: one spawn event, one child."""
    _run_workers(pg_dsn, "run-respawn", "spawn", 2, processes=1)
    _run_workers(pg_dsn, "run-respawn", "spawn", 2, processes=1)
    spawns = _rows(
        pg_dsn,
        "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-respawn' "
        "AND event_type = 'agent_spawn'",
    )
    children = _rows(
        pg_dsn,
        "SELECT agent_id, parent_agent_id FROM agentcap.agents "
        "WHERE run_id = 'run-respawn' AND parent_agent_id IS NOT NULL",
    )
    starts = _rows(
        pg_dsn,
        "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-respawn' "
        "AND agent_id = 'worker/h' AND event_type = 'agent_start'",
    )
    assert spawns == [(1,)]
    assert children == [("worker/h", "worker")]
    assert starts == [(2,)]
    assert _rows(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == [(0,)]
