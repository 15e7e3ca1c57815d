"""The otel-agentcap command: output formats and one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import psycopg
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


@pytest.mark.storage
@pytest.mark.parametrize(
    "command",
    [
        ("runs",),
        ("show", "r"),
        ("export", "r", "--format", "otlp-json"),
        ("event", "r", "00000000-0000-0000-0000-000000000000"),
    ],
)
def test_a_database_without_the_schema_is_one_line_that_says_what_to_run(pg_empty_dsn, command):
    """Reading a database nobody migrated says so in one line, naming the command that fixes it
    (not the SQL error over three lines, nor a Python function to call)."""
    result = _cli(*command, "--dsn", pg_empty_dsn)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "run `otel-agentcap db migrate`" in lines[0], result.stderr


def test_a_password_in_a_dsn_is_never_printed():
    """libpq quotes a URI it cannot parse in its error, password included; the command line
    prints it with the password replaced."""
    result = _cli("runs", "--dsn", "postgresql://agent:s3cret-pw@[bad/db")
    assert result.returncode == 1
    assert "s3cret-pw" not in result.stderr + result.stdout
    assert "postgresql://agent:***@[bad/db" in result.stderr


@pytest.mark.parametrize(
    ("dsn", "older_libpq_accepts_it"),
    [
        ("postgresql://agent:s3cret%zz@h/db", False),
        ("postgresql://agent:s3cret pw@h/db", True),
        ("host=h user=agent s3cret", False),
    ],
)
def test_a_password_libpq_quotes_alone_is_never_printed(dsn, older_libpq_accepts_it):
    """libpq names the token it cannot parse (a password with a bad percent-escape or a space,
    a password whose 'password=' was left out) without the rest of the DSN; the command line
    prints the error with that token replaced. (Older libpq releases, as psycopg-binary 3.2.1
    ships, take a space in a URI's password and fail to connect instead: one line, no password.)"""
    result = _cli("runs", "--dsn", dsn)
    assert result.returncode == 1
    assert "s3cret" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "***" in lines[0] if "invalid DSN" in lines[0] else "cannot connect" in lines[0]
    if not older_libpq_accepts_it:
        assert "invalid DSN" in lines[0], result.stderr


@pytest.mark.parametrize("action", ["status", "drain"])
def test_queue_commands_refuse_a_dsn_libpq_cannot_parse_without_printing_it(tmp_path, action):
    """queue status and drain name a DSN they cannot parse as invalid on one line (exit 1), as
    the other commands do, rather than print it, password included, as the queue's database,
    and make no directory named after it."""
    dsn = "host=h password=s3cret bogus=1"
    result = _cli("queue", action, "--queue-dir", str(tmp_path / "q"), "--dsn", dsn)
    assert result.returncode == 1, result.stdout
    assert "s3cret" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid DSN" in lines[0], result.stderr
    assert not (tmp_path / "q").exists()


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


_LOCKED = (
    "otel-agentcap: gave up after {} s waiting for a lock another session holds on the event "
    "log (a migration or other DDL?); try again later, or wait longer with --lock-timeout"
)


@pytest.mark.storage
def test_read_commands_give_up_waiting_for_a_lock_with_one_line(pg_dsn, tmp_path):
    """runs, show, event and export give up after --lock-timeout seconds (10 by default) while
    another session holds a lock on the log's tables (a migration, DDL): one line, exit 1."""
    event_id = "00000000-0000-4000-8000-000000000000"
    commands = [
        ("runs",),
        ("show", "r"),
        ("event", "r", event_id),
        ("export", "r", "--format", "otlp-json", "-o", str(tmp_path / "r.json")),
        ("export", "r", "--format", "html", "-o", str(tmp_path / "r.html")),
    ]
    with psycopg.connect(pg_dsn) as holder:
        holder.execute("LOCK TABLE agentcap.runs, agentcap.events IN ACCESS EXCLUSIVE MODE")
        for command in commands:
            result = _cli(*command, "--dsn", pg_dsn, "--lock-timeout", "0.2")
            assert result.returncode == 1, command
            assert result.stderr.strip().splitlines() == [_LOCKED.format("0.2")], command
        result = _cli("runs", "--dsn", pg_dsn)
        assert result.returncode == 1
        assert result.stderr.strip().splitlines() == [_LOCKED.format("10")]
    assert not list(tmp_path.iterdir())


@pytest.mark.storage
def test_ui_gives_up_on_a_locked_schema_at_start_with_one_line(pg_dsn):
    """ui checks the schema before serving: while another session holds a lock on it (a
    migration), it gives up after --lock-timeout seconds with the same one line, exit 1."""
    with psycopg.connect(pg_dsn) as holder:
        holder.execute("LOCK TABLE agentcap.schema_version IN ACCESS EXCLUSIVE MODE")
        result = _cli("ui", "--dsn", pg_dsn, "--port", "0", "--lock-timeout", "0.2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [_LOCKED.format("0.2")]


@pytest.mark.storage
@pytest.mark.parametrize("table", ["agentcap.events", "agentcap.schema_version"])
def test_write_commands_give_up_waiting_for_a_lock_with_one_line(pg_dsn, tmp_path, table):
    """import, db migrate, db partitions and db prune give up after --lock-timeout seconds while
    another session holds a lock on the log (a LOCK TABLE in psql, a migration): one line, exit
    1, nothing imported; they no longer wait without limit."""
    from otlp_support import captured, request_bytes

    spans, _ = captured("run-locked")
    path = tmp_path / "run.otlp"
    path.write_bytes(request_bytes(spans))
    commands = [
        ("import", str(path)),
        ("db", "migrate"),
        ("db", "partitions", "--ahead", "2"),
        ("db", "prune", "--before", "2020-01-01"),
    ]
    with psycopg.connect(pg_dsn) as holder:
        holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        for command in commands:
            result = _cli(*command, "--dsn", pg_dsn, "--lock-timeout", "0.2")
            if command == ("db", "migrate") and table == "agentcap.events":
                assert result.returncode == 0, result.stderr  # up to date: reads no other table
                continue
            assert result.returncode == 1, (command, result.stdout)
            assert result.stderr.strip().splitlines() == [_LOCKED.format("0.2")], command
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM agentcap.events").fetchone()
    assert row == (0,)


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
def test_export_of_agentcap_pb_to_stdout_or_a_file_and_a_failure_leaves_no_part_written_file(
    pg_dsn, tmp_path, monkeypatch, capsysbinary
):
    """export --format agentcap-pb writes the same bytes to standard output as to a file (which
    it names with its size, with the permissions a new file gets); an unknown run creates no
    file; a database error part-way through the events is one line, exit 1, and leaves neither a
    part-written file nor a temporary one, and an existing file as it was."""
    from otel_agentcap.cli import main
    from otel_agentcap.testing.synthetic import synthetic_run, write_batches
    from otel_agentcap.transfer import snapshot

    write_batches(pg_dsn, synthetic_run("exported", 2500, agents=3))
    command = ["export", "exported", "--format", "agentcap-pb", "--dsn", pg_dsn]
    piped = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", *command], capture_output=True, timeout=120
    )
    assert piped.returncode == 0 and len(piped.stdout) > 0, piped.stderr
    target = tmp_path / "run.pb"
    written = _cli(*command, "-o", str(target))
    assert written.returncode == 0 and target.read_bytes() == piped.stdout
    assert written.stderr == f"wrote {target} ({len(piped.stdout):,} bytes)\n"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    # A device (or a FIFO) is written in place, not replaced by a file.
    assert main([*command, "-o", os.devnull]) == 0
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    missing = tmp_path / "missing.pb"
    unknown = _cli("export", "nope", "--format", "agentcap-pb", "--dsn", pg_dsn, "-o", str(missing))
    assert unknown.returncode == 1 and not missing.exists()

    broken = tmp_path / "broken.pb"
    events = snapshot.RunReader.events
    begun: list[list[str]] = []

    def failing(self: snapshot.RunReader) -> Any:
        for number, row in enumerate(events(self)):
            if number == 1500:
                begun.append(sorted(p.name for p in tmp_path.iterdir()))
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            yield row

    monkeypatch.setattr(snapshot.RunReader, "events", failing)
    capsysbinary.readouterr()
    assert main([*command, "-o", str(broken)]) == 1
    # Written under a temporary name beside the target, removed on failure.
    assert len(begun) == 1 and "broken.pb" not in begun[0]
    assert [n for n in begun[0] if n.startswith(".broken.pb.") and n.endswith(".part")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pb"]
    assert capsysbinary.readouterr().err == (
        b"otel-agentcap: database error: server closed the connection unexpectedly\n"
    )
    assert main([*command, "-o", str(target)]) == 1
    assert target.read_bytes() == piped.stdout  # the earlier export, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pb"]


@pytest.mark.storage
def test_ui_refuses_a_public_address_without_a_token(pg_dsn):
    """ui on a non-loopback address without a token exits 1 with one line, serving nothing."""
    env = {k: v for k, v in os.environ.items() if k != "AGENTCAP_UI_TOKENS"}
    result = _cli("ui", "--host", "0.0.0.0", "--port", "0", "--dsn", pg_dsn, env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--token-file" in lines[0], result.stderr
    assert "AGENTCAP_UI_TOKENS" in lines[0]


@pytest.mark.parametrize("command", ["ui", "ingest"])
def test_unusable_tokens_are_one_line_before_serving(tmp_path, command):
    """A token file or variable entry that cannot be used is one line naming the entry, never
    the token, and exit 1, for ui and ingest alike; TLS options are checked the same way."""
    variable = {"ui": "AGENTCAP_UI_TOKENS", "ingest": "AGENTCAP_INGEST_TOKENS"}[command]
    dsn = "postgresql://postgres@127.0.0.1:1/x"
    env = {**os.environ, variable: "fine-token-0123456789,secret!"}
    result = _cli(command, "--port", "0", "--dsn", dsn, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"otel-agentcap: {variable}, entry 2: a token must be RFC 6750 b64token characters"
    ]
    empty = tmp_path / "tokens"
    empty.write_text("# none\n")
    result = _cli(command, "--port", "0", "--dsn", dsn, "--token-file", str(empty))
    assert result.returncode == 1 and "holds no token" in result.stderr
    result = _cli(command, "--port", "0", "--dsn", dsn, "--tls-cert", "c.pem")
    assert result.stderr.strip().splitlines() == [
        "otel-agentcap: give both --tls-cert and --tls-key"
    ]


@pytest.mark.storage
def test_ui_takes_its_tokens_from_the_environment_and_stops_on_sigint(pg_dsn):
    """ui with AGENTCAP_UI_TOKENS (the token file's format) answers 401 without a token and
    shows the token's runs with it; SIGINT stops it with status 0."""
    from otel_agentcap.testing.synthetic import synthetic_run, write_batches

    for run_id in ("team-a/1", "team-b/1"):
        write_batches(pg_dsn, synthetic_run(run_id, 20, agents=2))
    token = "ui-team-token-0123456789"
    env = {**os.environ, "AGENTCAP_UI_TOKENS": f"{token} team-a/*"}
    process = subprocess.Popen(
        [sys.executable, "-m", "otel_agentcap.cli", "ui", "--port", "0", "--dsn", pg_dsn],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        match = re.search(r"serving the event log at (http://127\.0\.0\.1:\d+)/", line)
        assert match, line
        url = match.group(1)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/api/runs", timeout=20)
        assert refused.value.code == 401
        request = urllib.request.Request(
            f"{url}/api/runs", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=20) as answer:
            runs = json.loads(answer.read())["runs"]
        assert [r["run_id"] for r in runs] == ["team-a/1"]
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def _closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the command with its standard output closed by the reader before it writes (what
    `| head -2` does to the rest of a long output)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "otel_agentcap.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read()
    process.stderr.close()
    return subprocess.CompletedProcess(process.args, process.wait(timeout=120), "", stderr)


@pytest.mark.storage
def test_show_names_each_parent_and_totals_what_the_log_holds(pg_dsn):
    """show names every causal parent as agent#seq of a stored event, and its totals (run and
    per agent) are what SQL counts in the log; the demo ends quietly with its output closed."""
    demo = _closed_stdout("demo", "--dsn", pg_dsn, "--json")
    assert demo.returncode in (0, 141) and "Traceback" not in demo.stderr, demo.stderr
    runs = json.loads(_cli("runs", "--dsn", pg_dsn, "--json").stdout)
    run_id = runs[0]["run_id"]
    data = json.loads(_cli("show", run_id, "--dsn", pg_dsn, "--json").stdout)
    by_id = {e["event_id"]: e for e in data["events"]}
    named = 0
    for event in data["events"]:
        for parent in event["causal_parents"]:
            stored = by_id[parent["event_id"]]
            assert (parent["agent_id"], parent["seq"]) == (stored["agent_id"], stored["seq"])
            named += 1
    assert named > 10
    import psycopg

    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE event_type = 'model_call'),"
            " coalesce(sum((payload->'usage'->>'input_tokens')::bigint), 0),"
            " coalesce(sum((payload->'usage'->>'output_tokens')::bigint), 0),"
            " count(*) FILTER (WHERE event_type = 'tool_invocation'),"
            " count(*) FILTER (WHERE event_type = 'agent_error' AND payload ? 'invocation_id'),"
            " count(*)"
            " FROM agentcap.events WHERE run_id = %s",
            (run_id,),
        ).fetchone()
        per_agent = dict(
            conn.execute(
                "SELECT agent_id, count(*) FROM agentcap.events WHERE run_id = %s GROUP BY 1",
                (run_id,),
            ).fetchall()
        )
    run = data["totals"]["run"]
    assert row == (
        run["model_calls"],
        run["input_tokens"],
        run["output_tokens"],
        run["tool_calls"],
        run["tool_failures"],
        run["events"],
    )
    assert run["tool_failures"] >= 1 and run["input_tokens"] > 0
    assert {a: t["events"] for a, t in data["totals"]["agents"].items()} == per_agent
    shown = _cli("show", run_id, "--dsn", pg_dsn)
    assert shown.returncode == 0, shown.stderr
    assert "<- planner#" in shown.stdout
    totals_line = next(
        line for line in shown.stdout.splitlines() if line.strip().startswith("run ")
    )
    assert totals_line.split()[1] == str(run["model_calls"])


@pytest.mark.storage
def test_show_payloads_and_content(pg_dsn):
    """--payloads prints each payload under its event; a model call's content only with
    --content."""
    demo = _cli("demo", "--dsn", pg_dsn, "--run-id", "run-payloads")
    assert demo.returncode == 0, demo.stderr
    plain = _cli("show", "run-payloads", "--dsn", pg_dsn)
    payloads = _cli("show", "run-payloads", "--dsn", pg_dsn, "--payloads")
    content = _cli("show", "run-payloads", "--dsn", pg_dsn, "--content")
    assert '"invocation_id"' not in plain.stdout
    assert '"invocation_id"' in payloads.stdout and '"usage"' in payloads.stdout
    assert len(content.stdout) >= len(payloads.stdout)


@pytest.mark.storage
@pytest.mark.parametrize(
    "command",
    [("runs",), ("runs", "--json"), ("show", "run-pipe"), ("show", "run-pipe", "--json")],
)
def test_output_to_a_closed_pipe_ends_quietly(pg_dsn, command):
    """Every command whose reader goes away stops without a traceback (`... | head -2`)."""
    demo = _cli("demo", "--dsn", pg_dsn, "--run-id", "run-pipe")
    assert demo.returncode == 0, demo.stderr
    result = _closed_stdout(*command, "--dsn", pg_dsn)
    assert result.stderr == "", result.stderr
    assert result.returncode == 141


@pytest.mark.parametrize("command", [("db", "status"), ("db", "dsn", "--dsn", "x=y")])
def test_db_commands_to_a_closed_pipe_end_quietly(command):
    """The db commands too stop quietly when their reader is gone."""
    result = _closed_stdout(*command)
    assert result.stderr == "", result.stderr
    assert result.returncode == 141


HOSTILE_IDS = ["[/bogus]", "[bold red]loud[/]", "\x1b[2J\x1b[31mcleared", "rtl \u202egnp.exe"]
#: An agent id whose line break would print a line that reads as an event of the timeline.
_FAKE_LINE_AGENT = "b\n     99  agent_end\tforged"


def _store_hostile_runs(dsn: str) -> None:
    from datetime import UTC, datetime

    from psycopg_pool import ConnectionPool

    from otel_agentcap.exporters.postgres.writer import EventWriter
    from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, event_id_for

    at = datetime(2026, 1, 1, tzinfo=UTC)
    events, agents, runs = [], [], []
    for run_id in HOSTILE_IDS:
        for agent in ("[/agent]", "a\x1b]0;title\x07", _FAKE_LINE_AGENT):
            events.append(
                Event(
                    event_id_for(run_id, agent, "seq:1"),
                    run_id,
                    agent,
                    1,
                    "memory_write",
                    "seq:1",
                    at,
                    payload={"memory": "[/m]", "key": "\x1b[5m"},
                )
            )
            agents.append(AgentRecord(run_id, agent, name="[red]name", lineage_known=True))
        runs.append(RunRecord(run_id, at, {"[/k]": "[/v]"}))
    with ConnectionPool(dsn, min_size=1, max_size=1) as pool:
        writer = EventWriter(pool)
        assert writer.write(Batch(tuple(events), tuple(agents), tuple(runs))).inserted == 12
        writer.close()


def _plain(output: str) -> None:
    """What a terminal would act on never reaches it: no ESC, no BEL, no bidi override."""
    assert not any(c in output for c in ("\x1b", "\x07", "\u202e")), repr(output)


@pytest.mark.storage
def test_hostile_run_ids_are_printed_as_text_by_every_command(pg_dsn):
    """Run and agent ids holding rich markup, escape sequences or bidi overrides are printed as
    text by runs and show (plain and --json), and by demo and the unknown-run error, without a
    MarkupError and without control characters reaching the terminal."""
    _store_hostile_runs(pg_dsn)
    runs = _cli("runs", "--dsn", pg_dsn)
    assert runs.returncode == 0, runs.stderr
    assert "[/bogus]" in runs.stdout and "[bold red]loud[/]" in runs.stdout
    assert "\\x1b[2J\\x1b[31mcleared" in runs.stdout
    _plain(runs.stdout)
    listed = json.loads(_cli("runs", "--dsn", pg_dsn, "--json").stdout)
    assert {r["run_id"] for r in listed} == set(HOSTILE_IDS)
    for run_id in HOSTILE_IDS:
        shown = _cli("show", run_id, "--dsn", pg_dsn)
        assert shown.returncode == 0, shown.stderr
        assert "agent [/agent]" in shown.stdout and "(\\x1b" not in shown.stdout
        _plain(shown.stdout)
        assert "agent b\\n     99  agent_end\\tforged" in shown.stdout
        assert not any(line.lstrip().startswith("99") for line in shown.stdout.splitlines())
        data = json.loads(_cli("show", run_id, "--dsn", pg_dsn, "--json").stdout)
        assert data["run_id"] == run_id
        exported = _cli("export", run_id, "--format", "html", "--dsn", pg_dsn)
        assert exported.returncode == 0, exported.stderr
    missing = _cli("show", "[/none]\x1b[2J", "--dsn", pg_dsn)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    _plain(missing.stderr)
    demo = _cli("demo", "--run-id", "[/bogus-demo]\x1b[31m", "--dsn", pg_dsn)
    assert demo.returncode == 0, demo.stderr
    assert "[/bogus-demo]" in demo.stdout
    _plain(demo.stdout)


@pytest.mark.storage
def test_event_prints_ids_and_summaries_as_text(pg_dsn):
    """event prints the event's agent id and payload summary as text, as show does: rich markup
    in them is shown as written (no '\\[' added, no '[dim]' tags of its own on a pipe), and
    escape sequences and line breaks as \\xNN escapes."""
    from otel_agentcap.model import event_id_for

    _store_hostile_runs(pg_dsn)
    run_id = HOSTILE_IDS[0]
    for agent in ("a\x1b]0;title\x07", _FAKE_LINE_AGENT, "[/agent]"):
        event_id = event_id_for(run_id, agent, "seq:1")
        shown = _cli("event", run_id, event_id, "--dsn", pg_dsn)
        assert shown.returncode == 0, shown.stderr
        _plain(shown.stdout)
        lines = shown.stdout.splitlines()
        assert len(lines) == 3, shown.stdout  # the event, "parents: 0", "children: 0"
        assert "[dim]" not in shown.stdout and "\\[" not in shown.stdout
        assert lines[0].endswith(f"  {event_id}")
    assert (
        "[/agent]      1  memory_write"
        in _cli("event", run_id, event_id_for(run_id, "[/agent]", "seq:1"), "--dsn", pg_dsn).stdout
    )


def test_queue_commands_on_a_directory_that_is_not_one_or_not_there(tmp_path):
    """A --queue-dir that is a file is one error line (status 1) for status and drain; draining
    a directory that does not exist says there is nothing to drain and creates nothing."""
    a_file = tmp_path / "afile"
    a_file.write_text("not a directory")
    dsn = "postgresql://agentcap@127.0.0.1:1/none?connect_timeout=1"  # never connected to
    for action in ("status", "drain"):
        done = _cli("queue", action, "--dsn", dsn, "--queue-dir", str(a_file))
        assert done.returncode == 1
        assert done.stderr == f"otel-agentcap: the queue directory {a_file} is not a directory\n"
    missing = tmp_path / "typo"
    done = _cli("queue", "drain", "--dsn", dsn, "--queue-dir", str(missing))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("nothing to drain: no queue for this database in ")
    data = json.loads(
        _cli("queue", "drain", "--dsn", dsn, "--queue-dir", str(missing), "--json").stdout
    )
    assert data == {
        "drained": True,
        "spans_read": 0,
        "events_inserted": 0,
        "duplicates": 0,
        "conflicts": 0,
    }
    assert not missing.exists()


@pytest.mark.storage
@pytest.mark.fault
@pytest.mark.multiprocess
def test_queue_status_and_drain_deliver_what_a_killed_process_left(pg_dsn, tmp_path):
    """`queue status` lists a queue a SIGKILLed process left (its process gone), `queue drain`
    delivers it, and afterwards nothing waits and every event handed over is stored."""
    import signal
    import time

    from durable_support import read_counter, start_worker

    queue_dir = tmp_path / "queue"
    counter = tmp_path / "counter"
    worker = start_worker(
        pg_dsn, "run-drain", "a", ops=100_000, queue_dir=queue_dir, counter=counter
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        counter.exists() and read_counter(counter)[0] > 1500
    ):
        time.sleep(0.02)
    worker.send_signal(signal.SIGKILL)
    worker.wait(30)
    handed_over = read_counter(counter)[1]
    where = ["--dsn", pg_dsn, "--queue-dir", str(queue_dir), "--json"]
    status = json.loads(_cli("queue", "status", *where).stdout)
    assert [q["locked"] for q in status["queues"]] == [False]
    done = _cli("queue", "drain", *where)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["drained"] is True
    assert json.loads(_cli("queue", "status", *where).stdout)["queues"] == []
    with psycopg.connect(pg_dsn) as conn:
        stored = conn.execute(
            "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-drain'"
        ).fetchone()
    assert stored is not None and handed_over <= stored[0] <= handed_over + 2


@pytest.mark.storage
def test_db_partitions_and_prune(pg_dsn):
    """db partitions lists and creates ahead, db prune --dry-run says what would go, db prune
    removes whole runs before the cut and says which runs are kept whole."""
    from datetime import UTC, datetime

    from pg_log import write_runs

    write_runs(pg_dsn, [("jan", datetime(2025, 1, 9, tzinfo=UTC))])
    write_runs(pg_dsn, [("feb", datetime(2025, 2, 9, tzinfo=UTC))])
    listed = json.loads(_cli("db", "partitions", "--dsn", pg_dsn, "--json").stdout)
    assert listed["partition_interval"] == "1 mon" and listed["pruned_before"] is None
    lowers = [p["lower"] for p in listed["partitions"]]
    assert lowers[:2] == ["2025-01-01T00:00:00+00:00", "2025-02-01T00:00:00+00:00"]
    ahead = json.loads(_cli("db", "partitions", "--ahead", "4", "--dsn", pg_dsn, "--json").stdout)
    assert ahead["created"] == 3 * 3  # events, conflicts and spans: three more months each
    dry = _cli("db", "prune", "--before", "2025-02-20", "--dry-run", "--dsn", pg_dsn)
    assert dry.returncode == 0, dry.stderr
    assert "would remove 1 run(s) started before 2025-02-01 00:00" in dry.stdout
    assert "agentcap.events_p20250101" in dry.stdout
    assert "runs started from 2025-02-01 00:00 on are kept whole" in dry.stdout
    done = _cli("db", "prune", "--before", "2025-02-20", "--dsn", pg_dsn)
    assert done.returncode == 0, done.stderr
    assert "removed 1 run(s)" in done.stdout
    runs = json.loads(_cli("runs", "--dsn", pg_dsn, "--json").stdout)
    assert [r["run_id"] for r in runs] == ["feb"]
    missing = _cli("db", "prune", "--dsn", pg_dsn)
    assert missing.returncode == 1 and "needs --before" in missing.stderr
    bad = _cli("db", "partitions", "--interval", "fortnight", "--dsn", pg_dsn)
    assert bad.returncode == 1 and "partition interval" in bad.stderr
    week = json.loads(
        _cli("db", "partitions", "--interval", "7 days", "--dsn", pg_dsn, "--json").stdout
    )
    assert week["partition_interval"] == "7 days"


@pytest.mark.storage
def test_event_shows_parents_children_and_past(pg_dsn):
    """event RUN EVENT prints the event, its parents and children; --past its causal past;
    unknown runs and events and non-UUID ids are one-line errors."""
    from datetime import UTC, datetime

    from pg_log import run_batch, write_runs

    write_runs(pg_dsn, [("r", datetime(2025, 1, 9, tzinfo=UTC))])
    batch = run_batch("r", datetime(2025, 1, 9, tzinfo=UTC))
    end = next(
        e for e in batch.events if e.agent_id == "planner/w0" and e.event_type == "agent_end"
    )
    data = json.loads(_cli("event", "r", end.event_id, "--past", "--dsn", pg_dsn, "--json").stdout)
    assert data["event"]["event_id"] == end.event_id
    assert [e["event_type"] for e in data["parents"]] == ["tool_result"]
    assert [(e["agent_id"], e["event_type"]) for e in data["children"]] == [
        ("planner", "model_call")
    ]
    past = {(e["agent_id"], e["seq"]) for e in data["past"]}
    assert past == {("planner/w0", s) for s in range(end.seq)} | {
        ("planner", 0),
        ("planner", 1),
        ("planner", 2),
    }
    text = _cli("event", "r", end.event_id, "--dsn", pg_dsn)
    assert text.returncode == 0 and "parents: 1" in text.stdout and "children: 1" in text.stdout
    for args, message in (
        (("event", "nope", end.event_id), "unknown run id: 'nope'"),
        (("event", "r", "00000000-0000-0000-0000-000000000000"), "no event"),
        (("event", "r", "not-a-uuid"), "not an event id"),
    ):
        result = _cli(*args, "--dsn", pg_dsn)
        assert result.returncode == 1 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ("ui", "--jaeger-url", "javascript:alert(document.domain)//"),
        ("ui", "--jaeger-url", "jaeger:16686"),
        ("export", "r", "--format", "html", "--jaeger-url", "data:text/html,x"),
    ],
)
def test_a_jaeger_url_that_is_not_a_web_address_is_a_usage_error(args: tuple[str, ...]) -> None:
    """--jaeger-url must be an http:// or https:// address (status 2, naming the option): any
    other was taken as it was, and the view drew links to javascript: or data: addresses."""
    done = _cli(*args, "--dsn", "postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == 2, done.stderr
    assert "error: argument --jaeger-url: not an http:// or https:// address" in done.stderr


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("runs", "--limit", "-1"), "--limit"),
        (("runs", "--limit", "0"), "--limit"),
        (("db", "partitions", "--ahead", "-5"), "--ahead"),
        (("ingest", "--port", "70000"), "--port"),
        (("ingest", "--grpc-port", "-1"), "--grpc-port"),
        (("ingest", "--max-body-mib", "nan"), "--max-body-mib"),
        (("ingest", "--max-concurrent", "0"), "--max-concurrent"),
        (("ingest", "--max-spans", "0"), "--max-spans"),
        (("ingest", "--idle-timeout", "inf"), "--idle-timeout"),
        (("ui", "--port", "99999"), "--port"),
        (("queue", "drain", "--timeout", "-1"), "--timeout"),
    ],
)
def test_out_of_range_numbers_are_usage_errors(args: tuple[str, ...], option: str) -> None:
    """A number out of range is a usage error naming the option (status 2), before anything
    connects or binds: it was a traceback (a port over 65535, a negative --ahead), a database
    error (a negative --limit), "no runs stored yet" (--limit 0), or accepted (a negative drain
    timeout)."""
    done = _cli(*args, "--dsn", "postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == 2, done.stderr
    assert f"error: argument {option}: " in done.stderr
    assert "Traceback" not in done.stderr


_NOT_UTF8 = os.fsdecode(b"run-\xff")  # what Python makes of an argument's bytes that are not UTF-8


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("show", _NOT_UTF8), "run_id"),
        (("export", _NOT_UTF8, "--format", "html"), "run_id"),
        (("event", _NOT_UTF8, "73137de6-788f-5a5d-9b87-4d07f4f8bbc4"), "run_id"),
        (("event", "r", _NOT_UTF8), "event_id"),
        (("demo", "--run-id", _NOT_UTF8), "--run-id"),
        (("db", "grant", "--owner", _NOT_UTF8), "--owner"),
        (("db", "prune", "--before", _NOT_UTF8), "--before"),
        (
            ("export", "r", "--format", "html", "--jaeger-url", "http://h/" + _NOT_UTF8),
            "--jaeger-url",
        ),
    ],
)
def test_arguments_that_are_not_utf8_are_usage_errors(args: tuple[str, ...], option: str) -> None:
    """An id, name or address whose bytes are not UTF-8 is a usage error naming the option (exit
    status 2), not a UnicodeEncodeError traceback from sending it to PostgreSQL."""
    result = _cli(*args, "--dsn", "postgresql://agentcap@127.0.0.1:1/none?connect_timeout=2")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"argument {option}: not valid UTF-8" in result.stderr


@pytest.mark.parametrize("where", ["--dsn", "AGENTCAP_DSN"])
def test_a_dsn_that_is_not_utf8_is_one_line(where: str) -> None:
    """A DSN (option or environment) whose bytes are not UTF-8 is one 'invalid DSN' line and
    exit status 1, not a traceback."""
    dsn = "postgresql://agentcap@127.0.0.1:1/" + _NOT_UTF8
    env = {**os.environ, "AGENTCAP_DSN": dsn} if where == "AGENTCAP_DSN" else None
    result = _cli("runs", *(["--dsn", dsn] if where == "--dsn" else []), env=env)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == ["otel-agentcap: invalid DSN: not valid UTF-8"]
