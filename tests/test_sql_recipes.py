"""The README's SQL recipes, run against the demo's log: each answers its question."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

README = Path(__file__).resolve().parent.parent / "README.md"
RUN = "run-recipes"


def recipes() -> dict[str, str]:
    """The SQL blocks of the README's "SQL recipes" section, by their first comment line, with
    the psql variables :'run' and :'event' turned into query parameters."""
    text = README.read_text()
    section = text[text.index("### SQL recipes") :]
    section = section[: section.index("\n## ")]
    found = {}
    for block in re.findall(r"```sql\n(.*?)```", section, re.S):
        title = block.splitlines()[0].removeprefix("-- ").strip()
        found[title] = block.replace(":'run'", "%(run)s").replace(":'event'", "%(event)s")
    return found


@pytest.fixture
def demo_log(pg_dsn: str) -> str:
    """A database holding one demo run."""
    done = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", "demo", "--dsn", pg_dsn, "--run-id", RUN],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return pg_dsn


def _query(dsn: str, title: str, event: str | None = None) -> list[dict[str, Any]]:
    sql = recipes()[title]
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, {"run": RUN, "event": event})
        return cur.fetchall()


def _events(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT event_id::text, agent_id, logical_seq, event_type, causal_parent_ids::text[]"
            " AS parents, payload FROM agentcap.events WHERE run_id = %s",
            (RUN,),
        )
        return cur.fetchall()


def test_the_readme_has_the_recipes():
    """The questions the README promises answers to are there."""
    titles = " | ".join(recipes())
    for question in (
        "model -> tool -> model",
        "what an agent saw before a decision",
        "token totals per agent",
        "everything downstream of one event",
    ):
        assert question in titles


@pytest.mark.storage
def test_recipes_answer_their_questions_on_the_demo_log(demo_log):
    """Chains, causal past, token totals, downstream and the plain queries, checked against
    the events themselves."""
    events = _events(demo_log)
    by_id = {e["event_id"]: e for e in events}
    titles = {title.split(":")[0]: title for title in recipes()}

    in_order = _query(demo_log, titles["a run in causal order per agent"])
    assert len(in_order) == len(events)

    chains = _query(demo_log, titles["the model -> tool -> model chains"])
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    asked = [
        i for i in invocations if any(by_id[p]["event_type"] == "model_call" for p in i["parents"])
    ]
    assert len(chains) >= len(asked) > 0
    assert {c["outcome"] for c in chains} == {
        "tool_result",
        "agent_error",
    }  # the demo's failing tool
    for chain in chains:
        assert chain["read_at"] > chain["asked_at"] or chain["read_by"] != chain["agent_id"]

    # The final answer: the writer's last model call.
    decision = max(
        (e for e in events if e["event_type"] == "model_call" and e["agent_id"].endswith("writer")),
        key=lambda e: e["logical_seq"],
    )
    seen = _query(demo_log, titles["what an agent saw before a decision"], decision["event_id"])
    kinds = {(row["agent_id"] == decision["agent_id"], row["event_type"]) for row in seen}
    assert (True, "memory_read") in kinds  # it read the findings
    assert (False, "tool_result") in kinds  # which other agents' tools produced
    for row in seen:
        assert (
            row["agent_id"] != decision["agent_id"] or row["logical_seq"] < decision["logical_seq"]
        )

    tokens = _query(demo_log, titles["token totals per agent"])
    for row in tokens:
        calls = [
            e
            for e in events
            if e["agent_id"] == row["agent_id"] and e["event_type"] == "model_call"
        ]
        assert row["model_calls"] == len(calls)
        assert row["input_tokens"] == sum(c["payload"]["usage"]["input_tokens"] for c in calls)
        assert row["output_tokens"] == sum(
            c["payload"]["usage"].get("output_tokens", 0) for c in calls
        )
    assert sum(r["model_calls"] for r in tokens) == sum(
        e["event_type"] == "model_call" for e in events
    )

    # Downstream of the root agent's start is every other event of the run.
    root_start = min(
        (e for e in events if e["agent_id"] == "planner"), key=lambda e: e["logical_seq"]
    )
    downstream = _query(
        demo_log, titles["everything downstream of one event"], root_start["event_id"]
    )
    assert len(downstream) == len(events) - 1
    # Downstream of a spawn: the child's whole execution, and nothing of the parent before it.
    spawn = next(e for e in events if e["event_type"] == "agent_spawn")
    below = _query(demo_log, titles["everything downstream of one event"], spawn["event_id"])
    child = spawn["payload"]["child_agent_id"]
    child_events = [e for e in events if e["agent_id"] == child]
    assert {(r["agent_id"], r["logical_seq"]) for r in below} >= {
        (e["agent_id"], e["logical_seq"]) for e in child_events
    }
    assert all(r["agent_id"] != "planner" or r["logical_seq"] > spawn["logical_seq"] for r in below)

    tree = _query(demo_log, titles["the spawn tree"])
    assert {r["agent_id"] for r in tree} == {e["agent_id"] for e in events}
