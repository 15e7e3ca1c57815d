"""The otel-agentcap command: output formats and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.storage
def test_runs_show_and_json_after_demo(pg_dsn):
    """demo, runs and show work together; --json parses; piped output has no terminal codes."""
    demo = _cli("demo", "--dsn", pg_dsn)
    assert demo.returncode == 0, demo.stderr
    assert "next: otel-agentcap show " in demo.stdout
    runs = json.loads(_cli("runs", "--dsn", pg_dsn, "--json").stdout)
    assert len(runs) == 1 and runs[0]["events"] > 30
    run_id = runs[0]["run_id"]
    shown = _cli("show", run_id, "--dsn", pg_dsn)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b[" not in shown.stdout
    assert "agent planner" in shown.stdout
    assert "agent_spawn" in shown.stdout
    # Children are indented under their parent.
    child_line = next(line for line in shown.stdout.splitlines() if "agent planner/writer" in line)
    assert child_line.startswith("    ")
    data = json.loads(_cli("show", run_id, "--dsn", pg_dsn, "--json").stdout)
    assert {e["event_type"] for e in data["events"]} >= {
        "agent_spawn",
        "tool_result",
        "memory_read",
    }


@pytest.mark.storage
def test_unknown_run_is_one_line_and_nonzero(pg_dsn):
    """An unknown run id prints one clear line and exits non-zero, without a traceback."""
    result = _cli("show", "no-such-run", "--dsn", pg_dsn)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "otel-agentcap: unknown run id: 'no-such-run' (see: otel-agentcap runs)"
    ]


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://postgres@127.0.0.1:1/x?connect_timeout=2", "cannot connect to PostgreSQL"),
        ("not a dsn at all", "invalid DSN"),
    ],
)
def test_bad_dsn_and_server_down_are_one_line(dsn, expected):
    """A server that is down or a malformed DSN prints one line and exits 1."""
    result = _cli("runs", "--dsn", dsn)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.storage
def test_export_html_writes_one_self_contained_file(pg_dsn, tmp_path):
    """export --format html writes the run's page to stdout or a file; an unknown run is one
    line and exit 1."""
    from otel_agentcap.testing.synthetic import synthetic_run, write_batches

    write_batches(pg_dsn, synthetic_run("exported", 50, agents=3))
    out = _cli("export", "exported", "--format", "html", "--dsn", pg_dsn)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("<!doctype html>")
    assert 'id="agentcap-data"' in out.stdout and "Content-Security-Policy" in out.stdout
    target = tmp_path / "run.html"
    written = _cli("export", "exported", "--format", "html", "--dsn", pg_dsn, "-o", str(target))
    assert written.returncode == 0 and target.read_text() == out.stdout
    unknown = _cli("export", "nope", "--format", "html", "--dsn", pg_dsn)
    assert unknown.returncode == 1
    assert unknown.stderr.strip().splitlines() == [
        "otel-agentcap: unknown run id: 'nope' (see: otel-agentcap runs)"
    ]
    bad = _cli("export", "exported", "--format", "pdf", "--dsn", pg_dsn)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


@pytest.mark.storage
def test_ui_refuses_a_public_address_without_a_token(pg_dsn):
    """ui on a non-loopback address without a token exits 1 with one line, serving nothing."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "AGENTCAP_TOKEN"}
    result = _cli("ui", "--host", "0.0.0.0", "--port", "0", "--dsn", pg_dsn, env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--token-file" in lines[0], result.stderr
