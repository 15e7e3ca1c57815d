"""The demo's stored log keeps every invariant of DESIGN.md that a query can check."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg
import pytest

pytestmark = pytest.mark.storage


@pytest.fixture()
def demo_run(pg_dsn):
    out = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", "demo", "--dsn", pg_dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def _one(conn: psycopg.Connection, sql: str, *params: object) -> object:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def test_demo_log_invariants(pg_dsn, demo_run):
    """Sequences unique per agent, causal parents stored and lower, spawns point at parent spawns."""
    run_id = demo_run["run_id"]
    with psycopg.connect(pg_dsn) as conn:
        assert _one(conn, "SELECT count(*) FROM agentcap.events WHERE run_id = %s", run_id) > 30
        assert _one(conn, "SELECT count(*) FROM agentcap.conflicts") == 0
        assert (
            _one(
                conn,
                """SELECT count(*) FROM (
                     SELECT agent_id, logical_seq FROM agentcap.events WHERE run_id = %s
                     GROUP BY 1, 2 HAVING count(*) > 1) d""",
                run_id,
            )
            == 0
        )
        # Every causal parent is a stored event of the run with a smaller sequence.
        bad_parents = _one(
            conn,
            """SELECT count(*) FROM agentcap.events e
               CROSS JOIN LATERAL unnest(e.causal_parent_ids) AS p(id)
               LEFT JOIN agentcap.events pe ON pe.event_id = p.id
               WHERE e.run_id = %s
                 AND (pe.event_id IS NULL OR pe.run_id <> e.run_id
                      OR pe.logical_seq >= e.logical_seq)""",
            run_id,
        )
        assert bad_parents == 0
        with_parents = _one(
            conn,
            "SELECT count(*) FROM agentcap.events WHERE run_id = %s AND cardinality(causal_parent_ids) > 0",
            run_id,
        )
        assert with_parents > 10
        # Every child agent was spawned by an agent_spawn event of its parent in the same run.
        children = conn.execute(
            """SELECT a.agent_id, e.event_type, e.agent_id = a.parent_agent_id, e.run_id = a.run_id
               FROM agentcap.agents a
               LEFT JOIN agentcap.events e ON e.event_id = a.spawned_at_event_id
               WHERE a.run_id = %s AND a.parent_agent_id IS NOT NULL""",
            (run_id,),
        ).fetchall()
        assert len(children) >= 5
        assert all(row[1:] == ("agent_spawn", True, True) for row in children), children
        # Every agent but the roots has a spawn; every agent's first event is its agent_start.
        firsts = conn.execute(
            """SELECT DISTINCT ON (agent_id) agent_id, event_type FROM agentcap.events
               WHERE run_id = %s ORDER BY agent_id, logical_seq""",
            (run_id,),
        ).fetchall()
        assert {t for _, t in firsts} == {"agent_start"}


def test_demo_records_the_failed_tool_and_the_timeout(pg_dsn, demo_run):
    """The failing tool and the timed-out agent are in the log as agent_error events."""
    run_id = demo_run["run_id"]
    with psycopg.connect(pg_dsn) as conn:
        errors = conn.execute(
            """SELECT agent_id, payload->>'error_type', payload->>'timed_out'
               FROM agentcap.events WHERE run_id = %s AND event_type = 'agent_error'""",
            (run_id,),
        ).fetchall()
    assert any(r[2] == "true" and r[0] in demo_run["timed_out_agents"] for r in errors), errors
    assert any(r[1] == "PermissionError" for r in errors), errors


def test_demo_with_a_stored_run_id_fails_and_changes_nothing(pg_dsn, demo_run):
    """demo --run-id of a run the log holds exits 1 with one line, and stores nothing more."""
    run_id = demo_run["run_id"]
    with psycopg.connect(pg_dsn) as conn:
        before = _one(conn, "SELECT count(*) FROM agentcap.events WHERE run_id = %s", run_id)
    again = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", "demo", "--dsn", pg_dsn, "--run-id", run_id],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 1
    assert "already exists in the event log" in again.stderr
    # One line, beside the warning of a private part an older anthropic lacks (.ci/floors).
    lines = [
        line for line in again.stderr.splitlines() if not line.startswith("agentcap: anthropic")
    ]
    assert len(lines) == 1, again.stderr
    with psycopg.connect(pg_dsn) as conn:
        assert (
            _one(conn, "SELECT count(*) FROM agentcap.events WHERE run_id = %s", run_id) == before
        )


def _quick_start() -> str:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_the_quick_start_run_twice_records_two_runs(pg_dsn):
    """The README quick start, run twice, records two runs of 10 events each, none merged."""
    import os

    env = {**os.environ, "AGENTCAP_DSN": pg_dsn}
    run_ids = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _quick_start()],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        run_ids.append(done.stdout.strip().splitlines()[-1])
    assert run_ids[0] != run_ids[1]
    with psycopg.connect(pg_dsn) as conn:
        counts = conn.execute(
            "SELECT run_id, count(*), max(logical_seq) FROM agentcap.events GROUP BY run_id"
        ).fetchall()
    assert sorted(r[0] for r in counts) == sorted(run_ids)
    assert all(r[1] == counts[0][1] for r in counts)
