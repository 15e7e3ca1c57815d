"""otel-agentcap export / import: byte-identical round trips (agentcap-pb and OTLP/JSON) on the demo
and on a run with every event type, the Jaeger JSON the UI reads, and deduplicated imports."""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO, cast

import psycopg
import pytest
from opentelemetry import trace
from psycopg import sql

import otel_agentcap as ac
from otel_agentcap import jsonsafe
from otel_agentcap.exporters.postgres import PostgresSpanExporter, embedded
from otel_agentcap.exporters.postgres.database import Database
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import (
    EVENT_TYPES,
    AgentRecord,
    Batch,
    Event,
    RunRecord,
    SpanRecord,
    event_id_for,
)
from otel_agentcap.testing import capture_events
from otel_agentcap.transfer import agentcap_pb, load
from otel_agentcap.transfer.formats import export_run, export_run_to
from otel_agentcap.transfer.snapshot import ConflictRow, load_run

pytestmark = pytest.mark.storage


def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", *args], capture_output=True, timeout=180
    )


def _export(dsn: str, run_id: str, fmt: str, path: Path) -> bytes:
    done = _cli("export", run_id, "--dsn", dsn, "--format", fmt, "-o", str(path))
    assert done.returncode == 0, done.stderr.decode()
    return path.read_bytes()


def _import(dsn: str, path: Path) -> dict[str, Any]:
    done = _cli("import", str(path), "--dsn", dsn, "--json")
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def _demo(dsn: str) -> str:
    done = _cli("demo", "--dsn", dsn, "--json")
    assert done.returncode == 0, done.stderr.decode()
    return str(json.loads(done.stdout)["run_id"])


@dataclass(frozen=True)
class DemoLog:
    """A database of this test's own that holds one demo run."""

    dsn: str
    run_id: str


@pytest.fixture(scope="module")
def _demo_template(pg_server_dsn: str) -> Iterator[tuple[str, str]]:
    """A database the demo ran in once for the module: (its name, the run id). Most tests here
    start from a demo run; running the demo for each cost the module a quarter of its time."""
    name = f"agentcap_demo_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        dsn = embedded.dsn_for(pg_server_dsn, name)
        migrate(dsn)
        yield name, _demo(dsn)
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture()
def demo_log(pg_server_dsn: str, _demo_template: tuple[str, str]) -> Iterator[DemoLog]:
    """A new database copied from the module's demo database (CREATE DATABASE ... TEMPLATE)."""
    template, run_id = _demo_template
    name = f"agentcap_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    try:
        yield DemoLog(embedded.dsn_for(pg_server_dsn, name), run_id)
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _rows(dsn: str, run_id: str) -> dict[str, list[tuple[Any, ...]]]:
    queries = {
        "events": "SELECT event_id, agent_id, logical_seq, wall_time, event_type, causal_parent_ids,"
        " idempotency_key, trace_id, span_id, payload FROM agentcap.events WHERE run_id = %s"
        " ORDER BY event_id",
        "agents": "SELECT agent_id, name, parent_agent_id, spawned_at_event_id FROM agentcap.agents"
        " WHERE run_id = %s ORDER BY agent_id",
        "runs": "SELECT started_at, attributes, trace_id, root_span_id FROM agentcap.runs"
        " WHERE run_id = %s",
        "spans": "SELECT trace_id, span_id, parent_span_id, name, kind, start_time, end_time,"
        " status_code, status_message, service_name, scope_name FROM agentcap.spans"
        " WHERE run_id = %s ORDER BY span_id",
        "conflicts": "SELECT reason, existing_event_id, row_digest, detected_at, event_id"
        " FROM agentcap.conflicts WHERE run_id = %s ORDER BY event_id, reason",
    }
    with psycopg.connect(dsn) as conn:
        return {name: conn.execute(q, (run_id,)).fetchall() for name, q in queries.items()}


@pytest.mark.parametrize("fmt", ["agentcap-pb", "otlp-json"])
def test_demo_round_trip_is_byte_identical(demo_log, pg_empty_dsn, tmp_path, fmt):
    """Export the demo run, import it into an empty database, export again: the same bytes, the
    same rows, and the same Jaeger view."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    first = _export(pg_dsn, run_id, fmt, tmp_path / "first")
    result = _import(pg_empty_dsn, tmp_path / "first")
    assert result["runs"] == [run_id]
    assert result["events_inserted"] == len(_rows(pg_dsn, run_id)["events"])
    assert result["conflicts"] == 0
    second = _export(pg_empty_dsn, run_id, fmt, tmp_path / "second")
    assert second == first
    assert _rows(pg_empty_dsn, run_id) == _rows(pg_dsn, run_id)
    jaeger = [
        _export(dsn, run_id, "jaeger-json", tmp_path / f"jaeger-{i}")
        for i, dsn in enumerate((pg_dsn, pg_empty_dsn))
    ]
    assert jaeger[0] == jaeger[1]


def test_otlp_json_lines_import_as_the_whole_file_does(demo_log, pg_empty_dsn, tmp_path):
    """The demo's OTLP/JSON export written as JSON Lines, three spans a request, one request a
    line (as the OpenTelemetry Collector's file exporter writes), imports to the same rows as
    the file it came from; a line that is not JSON is a one-line error naming the line, and a
    document cut short keeps its own error."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = json.loads(_export(pg_dsn, run_id, "otlp-json", tmp_path / "whole.json"))
    lines = []
    for resource_spans in whole["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            spans = scope_spans["spans"]
            for start in range(0, len(spans), 3):
                part = {**scope_spans, "spans": spans[start : start + 3]}
                lines.append({"resourceSpans": [{**resource_spans, "scopeSpans": [part]}]})
    assert len(lines) > 2
    split = tmp_path / "split.jsonl"
    split.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = _import(pg_empty_dsn, split)
    assert result["runs"] == [run_id]
    assert result["events_inserted"] == len(_rows(pg_dsn, run_id)["events"])
    assert _rows(pg_empty_dsn, run_id) == _rows(pg_dsn, run_id)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(lines[0]) + "\n" + "{not json\n")
    done = _cli("import", str(broken), "--dsn", pg_empty_dsn)
    assert done.returncode == 1 and done.stderr.decode().count("\n") == 1
    assert b"line 2" in done.stderr
    # One document over many lines, cut short, is not read as JSON Lines: its own error.
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(whole, indent=2)[:-40])
    done = _cli("import", str(cut), "--dsn", pg_empty_dsn)
    assert done.returncode == 1 and done.stderr.decode().count("\n") == 1
    assert b"not OTLP/JSON: " in done.stderr and b"JSON Lines" not in done.stderr


def test_import_twice_stores_nothing_twice(demo_log, pg_empty_dsn, tmp_path):
    """A second import of the same file counts every event as a duplicate and changes no row."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    path = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", path)
    first = _import(pg_empty_dsn, path)
    before = _rows(pg_empty_dsn, run_id)
    second = _import(pg_empty_dsn, path)
    assert second["events_inserted"] == 0
    assert second["duplicates"] == first["events_inserted"]
    assert _rows(pg_empty_dsn, run_id) == before


#: Run attributes JSON cannot hold as they are: stored encoded once, read back as they were.
RUN_ATTRIBUTES: dict[str, Any] = {
    "purpose": "round trip",
    "n": 3,
    "key\x00": "lone \ud800",
    "raw": b"\x00\xff",
    "$agentcap.str": "a user key that looks like a marker",
}


def _every_event_type(run_id: str) -> None:
    """A run with every event type, odd payload values, a failed tool, a timed-out agent."""
    memory = ac.Memory("mem")
    chat = trace.get_tracer("test.genai")

    @ac.tool
    def echo(value: object) -> object:
        return value

    @ac.tool
    def broken() -> None:
        raise RuntimeError("no")

    with ac.run(run_id, **RUN_ATTRIBUTES), ac.agent("lead") as lead:
        memory["odd"] = {"bytes": b"\x00\xff", "nan": float("nan"), "text": "caf\u00e9 \U0001f600"}
        with chat.start_as_current_span(
            "chat m",
            attributes={"gen_ai.operation.name": "chat", "gen_ai.response.id": "msg_1"},
        ):
            pass
        child = lead.spawn("helper", key="h")
        child.run(lambda: (memory.lookup("odd"), echo.invoke("t1", [1, 2.5, None])))
        with pytest.raises(RuntimeError):
            child.run(lambda: broken.invoke("t2"))
        del memory["odd"]


def _stored_run(dsn: str, run_id: str) -> None:
    exporter = PostgresSpanExporter(dsn)
    with capture_events() as captured:
        _every_event_type(run_id)
    try:
        assert {e.event_type for e in captured.events} == EVENT_TYPES
        assert exporter.export(captured.spans).name == "SUCCESS"
        # And a conflict: a different event on a stored event's (run, agent, seq).
        stored = captured.for_agent("lead")[1]
        clash = Event(
            event_id_for(run_id, "lead", "other"),  # ids are derived (storage checks it)
            run_id,
            "lead",
            stored.seq,
            "memory_write",
            "other",
            stored.wall_time,
            payload={"other": True},
        )
        database = Database(dsn)
        writer = EventWriter(database.pool)
        assert writer.write(Batch(events=(clash,))).conflicts == 1
        writer.close()
        database.close()
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("fmt", ["agentcap-pb", "otlp-json"])
def test_round_trip_of_a_run_with_every_event_type(pg_dsn, pg_empty_dsn, tmp_path, fmt):
    """A run with every event type (a conflict too) exports, imports into an empty database and
    exports again to the same bytes; agentcap-pb carries its conflicts as well."""
    run_id = "every-type"
    _stored_run(pg_dsn, run_id)
    first = _export(pg_dsn, run_id, fmt, tmp_path / "first")
    result = _import(pg_empty_dsn, tmp_path / "first")
    second = _export(pg_empty_dsn, run_id, fmt, tmp_path / "second")
    assert second == first
    original, copied = _rows(pg_dsn, run_id), _rows(pg_empty_dsn, run_id)
    assert len(original["conflicts"]) == 1
    assert jsonsafe.from_jsonable(original["runs"][0][1]) == RUN_ATTRIBUTES
    if fmt == "agentcap-pb":
        assert result["conflicts_imported"] == 1
        assert copied == original
    else:  # OTLP carries the trace, not the conflicts
        assert {k: v for k, v in copied.items() if k != "conflicts"} == {
            k: v for k, v in original.items() if k != "conflicts"
        }


@pytest.mark.parametrize("fmt", ["agentcap-pb", "otlp-json"])
def test_round_trip_keeps_the_start_of_a_run_stored_before_its_root_span(pg_dsn, pg_empty_dsn, fmt):
    """A run whose first stored batch lacked its root span (as a collector delivers spans, in the
    order they end) started later in the log than that span: both formats carry the log's start,
    so the round trip gives the same bytes and the same rows."""
    run_id = "root-span-last"
    with capture_events() as captured, ac.run(run_id), ac.agent("a"):
        ac.Memory("m")["k"] = 1
    spans = list(captured.spans)
    assert spans[-1].name == f"invoke_workflow {run_id}"
    exporter = PostgresSpanExporter(pg_dsn)
    try:
        assert exporter.export(spans[:-1]).name == "SUCCESS"
        assert exporter.export(spans[-1:]).name == "SUCCESS"
    finally:
        exporter.shutdown()
    original = _rows(pg_dsn, run_id)
    (root,) = [s for s in original["spans"] if s[1] == original["runs"][0][3]]
    assert original["runs"][0][0] > root[5]  # the log's start is after the root span's
    with psycopg.connect(pg_dsn) as conn:
        first = export_run(conn, run_id, fmt)
    migrate(pg_empty_dsn)
    database = Database(pg_empty_dsn)
    try:
        load.import_file(database, first)
    finally:
        database.close()
    with psycopg.connect(pg_empty_dsn) as conn:
        assert export_run(conn, run_id, fmt) == first
    assert _rows(pg_empty_dsn, run_id) == original


def _check_jaeger_shape(document: dict[str, Any]) -> dict[str, Any]:
    """The shape the Jaeger UI reads from /api/traces (and from an uploaded file)."""
    assert isinstance(document["data"], list)
    (trace_data,) = document["data"]
    assert len(trace_data["traceID"]) == 32 and int(trace_data["traceID"], 16)
    processes = trace_data["processes"]
    assert processes and all(p["serviceName"] for p in processes.values())
    span_ids = {s["spanID"] for s in trace_data["spans"]}
    assert len(span_ids) == len(trace_data["spans"])
    for span in trace_data["spans"]:
        assert span["traceID"] == trace_data["traceID"]
        assert len(span["spanID"]) == 16 and int(span["spanID"], 16)
        assert isinstance(span["operationName"], str) and span["operationName"]
        assert isinstance(span["startTime"], int) and isinstance(span["duration"], int)
        assert span["duration"] >= 0
        assert span["processID"] in processes
        for tag in span["tags"]:
            assert set(tag) == {"key", "type", "value"}
            assert tag["type"] in ("string", "bool", "int64", "float64")
        for ref in span["references"]:
            assert ref["refType"] in ("CHILD_OF", "FOLLOWS_FROM")
            assert ref["traceID"] == trace_data["traceID"]
            assert ref["spanID"] in span_ids, ref
        child_of = [r for r in span["references"] if r["refType"] == "CHILD_OF"]
        assert len(child_of) <= 1
    return trace_data


def _tags(span: dict[str, Any]) -> dict[str, Any]:
    return {t["key"]: t["value"] for t in span["tags"]}


def test_jaeger_export_of_the_demo(pg_dsn, tmp_path):
    """The demo as Jaeger JSON: one trace, one span per captured operation under one root, every
    child invoke_agent CHILD_OF its create_agent, every causal parent a FOLLOWS_FROM reference."""
    run_id = _demo(pg_dsn)
    document = json.loads(_export(pg_dsn, run_id, "jaeger-json", tmp_path / "j.json"))
    trace_data = _check_jaeger_shape(document)
    spans = {s["spanID"]: s for s in trace_data["spans"]}
    with psycopg.connect(pg_dsn) as conn:
        operations = conn.execute(
            "SELECT count(DISTINCT span_id) FROM agentcap.events WHERE run_id = %s", (run_id,)
        ).fetchone()[0]
        events = conn.execute(
            "SELECT event_id::text, span_id, causal_parent_ids::text[] FROM agentcap.events"
            " WHERE run_id = %s",
            (run_id,),
        ).fetchall()
    assert len(spans) == operations + 1  # and the run's root span
    roots = [s for s in spans.values() if not s["references"]]
    assert [r["operationName"] for r in roots] == [f"invoke_workflow {run_id}"]
    children = 0
    for span in spans.values():
        tags = _tags(span)
        if tags.get("agentcap.parent.agent_id"):
            children += 1
            (parent_ref,) = [r for r in span["references"] if r["refType"] == "CHILD_OF"]
            parent = _tags(spans[parent_ref["spanID"]])
            assert parent["gen_ai.operation.name"] == "create_agent"
            assert parent["agentcap.child.agent_id"] == tags["agentcap.agent.id"]
    assert children >= 5
    span_of = {event_id: span_id for event_id, span_id, _ in events}
    links = 0
    for _, span_id, parents in events:
        for parent in parents:
            if span_of[parent] != span_id:
                follows = {
                    r["spanID"]
                    for r in spans[span_id]["references"]
                    if r["refType"] == "FOLLOWS_FROM"
                }
                assert span_of[parent] in follows
                links += 1
    assert links > 10
    names = [
        s["operationName"] for s in spans.values() if s["operationName"].startswith("invoke_agent")
    ]
    assert len(names) == len(set(names))  # every agent's row has a name of its own


def test_export_and_import_report_bad_input_in_one_line(pg_dsn, tmp_path):
    """An unknown run and an unreadable file are one-line errors with exit status 1."""
    done = _cli("export", "no-such-run", "--dsn", pg_dsn, "--format", "otlp-json")
    assert done.returncode == 1 and b"unknown run id" in done.stderr
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x07not a file")
    done = _cli("import", str(garbage), "--dsn", pg_dsn)
    assert done.returncode == 1 and done.stderr.decode().count("\n") == 1
    assert b"cannot import" in done.stderr


def test_import_names_what_is_wrong_with_a_file(demo_log, tmp_path):
    """A file cut short, an empty file and JSON nested past what can be read are one-line errors
    that say so (not tracebacks, not a guess at another format, not an import of nothing)."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = _export(pg_dsn, run_id, "agentcap-pb", tmp_path / "run.pb")
    nested = '{"resourceSpans": ' + "[" * 100_000 + "]" * 100_000 + "}"
    cases = {
        "cut.pb": (whole[: len(whole) // 3], "truncated agentcap-pb stream"),
        "empty": (b"", "the input is empty"),
        "blank": (b"\n  \n", "the input is empty"),
        "nested.json": (nested.encode(), "nested too deeply"),
        "nested.jsonl": (b'{"resourceSpans": []}\n' + nested.encode(), "nested too deeply"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        done = _cli("import", str(path), "--dsn", pg_dsn)
        assert done.returncode == 1, name
        assert done.stderr.decode().count("\n") == 1, (name, done.stderr.decode())
        assert message in done.stderr.decode(), (name, done.stderr.decode())


def test_import_counts_and_fails_on_records_it_leaves_out(demo_log, pg_empty_dsn, tmp_path):
    """Records of a file that break a validation rule (here: event ids that are not the ids of
    their run, agent and key, after the run id was edited) are left out, counted in the summary
    and in --json, and the import exits 1; what is valid is still stored."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    text = _export(pg_dsn, run_id, "otlp-json", tmp_path / "run.json").decode()
    edited = tmp_path / "edited.json"
    edited.write_text(text.replace(run_id, "edited-run"))
    done = _cli("import", str(edited), "--dsn", pg_empty_dsn, "--json")
    assert done.returncode == 1, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["events_inserted"] == 0 and result["rejected"] > 0
    assert b"broke a validation rule" in done.stderr
    done = _cli("import", str(edited), "--dsn", pg_empty_dsn)
    assert done.returncode == 1
    assert f"{result['rejected']} left out (invalid".encode() in done.stdout
    # An unedited file imports with status 0 and nothing left out.
    assert _import(pg_empty_dsn, tmp_path / "run.json")["rejected"] == 0


def _demo_otlp(demo: DemoLog, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = tmp_path / "run.json"
    return demo.run_id, json.loads(_export(demo.dsn, demo.run_id, "otlp-json", path))


def _import_error(dsn: str, path: Path) -> str:
    """The one line ``import`` prints for ``path``, which it refuses with status 1."""
    done = _cli("import", str(path), "--dsn", dsn)
    stderr = done.stderr.decode()
    assert done.returncode == 1, (path.name, stderr)
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, (path.name, stderr)
    return stderr


def _event_count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.execute("SELECT count(*) FROM agentcap.events").fetchone()[0])


def test_import_of_otlp_json_with_values_of_the_wrong_shape_is_one_line(
    demo_log, pg_empty_dsn, tmp_path
):
    """OTLP/JSON whose objects or lists hold values of another type (a number for a resource,
    a string for a scope, a list for a status, numbers for span events) is a one-line error and
    stores nothing."""
    _, whole = _demo_otlp(demo_log, tmp_path)

    def span(d: dict[str, Any]) -> dict[str, Any]:
        return d["resourceSpans"][0]["scopeSpans"][0]["spans"][0]

    edits = {
        "resource_number": lambda d: d["resourceSpans"].__setitem__(0, 1),
        "resource_spans_text": lambda d: d.__setitem__("resourceSpans", "abc"),
        "scope_text": lambda d: d["resourceSpans"][0]["scopeSpans"][0].__setitem__("scope", "x"),
        "status_list": lambda d: span(d).__setitem__("status", [1]),
        "events_numbers": lambda d: span(d).__setitem__("events", [1, 2]),
    }
    for name, edit in edits.items():
        document = json.loads(json.dumps(whole))
        edit(document)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        assert "malformed OTLP/JSON" in _import_error(pg_empty_dsn, path), name
    assert _event_count(pg_empty_dsn) == 0


def test_import_refuses_json_that_is_not_otlp(demo_log, pg_empty_dsn, tmp_path):
    """A JSON document with no resourceSpans (the run's Jaeger JSON, an empty object, another
    tool's JSON) is a one-line error saying so, not an import of nothing with status 0."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    jaeger = tmp_path / "jaeger.json"
    _export(pg_dsn, run_id, "jaeger-json", jaeger)
    assert "Jaeger JSON" in _import_error(pg_empty_dsn, jaeger)
    for name, text in {"empty_object": "{}", "other": '{"traces": []}'}.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        assert "not OTLP/JSON: no resourceSpans" in _import_error(pg_empty_dsn, path), name
    assert _event_count(pg_empty_dsn) == 0


def _edited_pb(source: Path, target: Path, edit: Any) -> Path:
    """``source`` (an agentcap-pb export of one run) with ``edit`` applied to its snapshot."""
    (snapshot,) = agentcap_pb.loads(source.read_bytes())
    target.write_bytes(agentcap_pb.dumps(edit(snapshot)))
    return target


def test_import_refuses_agentcap_pb_rows_of_a_run_it_has_no_record_of(
    demo_log, pg_empty_dsn, tmp_path
):
    """An agentcap-pb file whose events, agents, spans or conflicts name a run the file holds no
    run record of (a run record renamed by hand, one event moved to another run) is a one-line
    error naming that run, and stores nothing: no run made up from the events, no other rows
    dropped in silence."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", whole)
    (snapshot,) = agentcap_pb.loads(whole.read_bytes())
    event = snapshot.events[3]
    conflict = ConflictRow(
        "run_agent_seq",
        event.event_id,
        event.wall_time_us,
        "digest",
        replace(event, run_id="ghost-run"),
    )
    edits = {
        "run_renamed": lambda s: replace(s, run=replace(s.run, run_id="renamed-run")),
        "event_moved": lambda s: replace(
            s, events=(*s.events[:3], replace(s.events[3], run_id="ghost-run"), *s.events[4:])
        ),
        "span_moved": lambda s: replace(
            s, spans=(replace(s.spans[0], run_id="ghost-run"), *s.spans[1:])
        ),
        "agent_moved": lambda s: replace(
            s, agents=(replace(s.agents[0], run_id="ghost-run"), *s.agents[1:])
        ),
        "conflict_of_another_run": lambda s: replace(s, conflicts=(conflict,)),
    }
    for name, edit in edits.items():
        path = _edited_pb(whole, tmp_path / f"{name}.pb", edit)
        message = _import_error(pg_empty_dsn, path)
        assert "no record of that run" in message, (name, message)
        with psycopg.connect(pg_empty_dsn) as conn:
            assert conn.execute("SELECT count(*) FROM agentcap.runs").fetchone()[0] == 0, name


def test_import_of_agentcap_pb_json_nested_too_deeply_is_one_line(demo_log, pg_empty_dsn, tmp_path):
    """agentcap-pb run attributes or a payload nested deeper than can be read is a one-line error
    that says so and stores nothing, also when the run is the second of the file."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", whole)
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    deep_attributes = _edited_pb(
        whole,
        tmp_path / "attributes.pb",
        lambda s: replace(s, run=replace(s.run, attributes_json=deep)),
    )
    run_alone = _edited_pb(
        whole,
        tmp_path / "run-alone.pb",
        lambda s: replace(
            s,
            run=replace(s.run, run_id="second", attributes_json=deep),
            agents=(),
            spans=(),
            events=(),
            conflicts=(),
        ),
    )
    deep_payload = _edited_pb(
        whole,
        tmp_path / "payload.pb",
        lambda s: replace(
            s, events=(replace(s.events[0], payload_json=f'["\\u0000", {deep}]'), *s.events[1:])
        ),
    )
    second = tmp_path / "second.pb"
    second.write_bytes(whole.read_bytes() + run_alone.read_bytes())
    for path in (deep_attributes, deep_payload, second):
        assert "nested too deeply" in _import_error(pg_empty_dsn, path), path.name
    with psycopg.connect(pg_empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM agentcap.runs").fetchone()[0] == 0


def test_an_import_that_fails_part_way_says_what_it_stored(
    pg_dsn, pg_empty_dsn, tmp_path, monkeypatch
):
    """When the log refuses a write after part of an agentcap-pb file was stored (a second run
    with a payload PostgreSQL cannot hold, a conflict row its unique index cannot hold), the
    one-line error says which runs were stored in full and what of the failing run was, and the
    rows stored are exactly those."""
    first_id, second_id = _demo(pg_dsn), _demo(pg_dsn)
    first, second = tmp_path / "first.pb", tmp_path / "second.pb"
    _export(pg_dsn, first_id, "agentcap-pb", first)
    _export(pg_dsn, second_id, "agentcap-pb", second)
    overflow = _edited_pb(
        second,
        tmp_path / "overflow.pb",
        lambda s: replace(s, events=(replace(s.events[0], payload_json="1e999999"), *s.events[1:])),
    )
    two_runs = tmp_path / "two-runs.pb"
    two_runs.write_bytes(first.read_bytes() + overflow.read_bytes())
    message = _import_error(pg_empty_dsn, two_runs)
    assert "stopped part-way" in message, message
    assert f"run {first_id!r} in full" in message and f"nothing of run {second_id!r}" in message
    stored = _rows(pg_empty_dsn, first_id)
    assert {k: v for k, v in stored.items() if k != "conflicts"} == {
        k: v for k, v in _rows(pg_dsn, first_id).items() if k != "conflicts"
    }
    assert _rows(pg_empty_dsn, second_id)["runs"] == []

    (snapshot,) = agentcap_pb.loads(second.read_bytes())
    event = snapshot.events[0]
    # A digest over the size the conflicts' unique index can hold (random: not compressible).
    digest = os.urandom(8000).hex()
    conflict = ConflictRow("run_agent_seq", event.event_id, event.wall_time_us, digest, event)
    bad_conflict = _edited_pb(
        second, tmp_path / "bad-conflict.pb", lambda s: replace(s, conflicts=(conflict,))
    )
    message = _import_error(pg_empty_dsn, bad_conflict)
    assert f"run {second_id!r} but for its 1 conflict rows" in message, message
    assert len(_rows(pg_empty_dsn, second_id)["events"]) == len(snapshot.events)

    # A run written in several batches, the third refused: the first two stay, and are named.
    monkeypatch.setattr(load, "EVENTS_PER_WRITE", 10)
    late = _edited_pb(
        second,
        tmp_path / "late.pb",
        lambda s: replace(
            s, events=(*s.events[:25], replace(s.events[25], payload_json="1e999999"))
        ),
    )
    database = Database(pg_empty_dsn)
    try:
        with pytest.raises(load.ImportIncomplete) as failed:
            load.import_file(database, late.read_bytes())
    finally:
        database.close()
    assert f"of run {second_id!r} its run, agent and span records and 20 of its 26 events" in str(
        failed.value
    )


def test_import_summary_shows_control_characters_of_run_ids_as_escapes(
    pg_dsn, pg_empty_dsn, tmp_path
):
    """A run id from the file that holds terminal controls (an escape sequence, a line break, a
    bidirectional override) is printed in the import's summary as escapes, on one line."""
    run_id = "r\x1b]0;title\x07\x1b[31mred\nfake line \u202e"
    exporter = PostgresSpanExporter(pg_dsn)
    try:
        with capture_events() as captured, ac.run(run_id), ac.agent("lead"):
            ac.Memory("m")["k"] = 1
        assert exporter.export(captured.spans).name == "SUCCESS"
    finally:
        exporter.shutdown()
    path = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", path)
    done = _cli("import", str(path), "--dsn", pg_empty_dsn)
    assert done.returncode == 0, done.stderr.decode()
    summary = done.stdout.decode()
    assert summary.count("\n") == 1 and "\x1b" not in summary and "\u202e" not in summary
    assert "r\\x1b]0;title\\x07\\x1b[31mred\\nfake line \\u202e" in summary, summary


def test_import_of_otlp_json_times_outside_64_bits_is_one_line(demo_log, pg_empty_dsn, tmp_path):
    """OTLP/JSON span or span event times that are no 64-bit count of nanoseconds (Infinity,
    1e400, 10**30, a negative number) are a one-line 'malformed OTLP/JSON' error that stores
    nothing, not a traceback nor spans left out one by one."""
    _, whole = _demo_otlp(demo_log, tmp_path)
    text = json.dumps(whole)
    spans = [s for r in whole["resourceSpans"] for ss in r["scopeSpans"] for s in ss["spans"]]
    first_start = spans[0]["startTimeUnixNano"]
    ends = {s["endTimeUnixNano"] for s in spans}
    spans[0]["events"] = [{"timeUnixNano": "1" + "0" * 30, "name": "late"}]
    cases = {
        "infinity": text.replace(f'"{first_start}"', "Infinity"),
        "float_overflow": text.replace(f'"{first_start}"', "1e400"),
        "negative": text.replace(f'"{first_start}"', '"-5"'),
        "event_time": json.dumps(whole),
    }
    for end in ends:
        text = text.replace(f'"{end}"', '"1' + "0" * 30 + '"')
    cases["end_times"] = text
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(data)
        assert "malformed OTLP/JSON" in _import_error(pg_empty_dsn, path), name
    assert _event_count(pg_empty_dsn) == 0


def test_import_refuses_agentcap_pb_cut_between_two_messages(demo_log, pg_empty_dsn, tmp_path):
    """An agentcap-pb file cut short exactly after one of its messages (its framing alone cannot
    show it) is the one-line 'truncated' error and stores nothing; so is a second run of a
    concatenated file cut so; whole files, concatenated or not, import."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = _export(pg_dsn, run_id, "agentcap-pb", tmp_path / "run.pb")
    ends = []
    position = 0
    while position < len(whole):
        size, position = agentcap_pb._read_varint(whole, position)
        position += size
        ends.append(position)
    assert len(ends) > 1 and ends[-1] == len(whole)
    for end in ends[:-1]:
        path = tmp_path / f"cut-{end}.pb"
        path.write_bytes(whole[:end])
        assert "truncated agentcap-pb stream" in _import_error(pg_empty_dsn, path)
        concatenated = tmp_path / f"then-cut-{end}.pb"
        concatenated.write_bytes(whole + whole[:end])
        assert "truncated agentcap-pb stream" in _import_error(pg_empty_dsn, concatenated)
    with psycopg.connect(pg_empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM agentcap.runs").fetchone()[0] == 0
    twice = tmp_path / "twice.pb"
    twice.write_bytes(whole + whole)
    assert _import(pg_empty_dsn, twice)["runs"] == [run_id]


def test_import_of_an_endless_file_runs_out_of_memory_in_one_line(pg_dsn):
    """``import /dev/zero`` (a file that never ends) under a memory limit is a one-line error
    saying that reading it ran out of memory, not a MemoryError traceback."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (300 * 2**20, 300 * 2**20))

    done = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", "import", "/dev/zero", "--dsn", pg_dsn],
        capture_output=True,
        timeout=180,
        preexec_fn=limit_memory,
    )
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr
    assert stderr == "otel-agentcap: cannot read /dev/zero: out of memory\n", stderr


def test_otlp_json_with_a_byte_order_mark_imports(demo_log, pg_empty_dsn, tmp_path):
    """OTLP/JSON saved with a UTF-8 byte order mark (as some Windows editors save it), one
    document or JSON Lines, imports as the file without it does."""
    pg_dsn = demo_log.dsn
    run_id, whole = _demo_otlp(demo_log, tmp_path)
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "run.json").read_bytes())
    result = _import(pg_empty_dsn, marked)
    assert result["runs"] == [run_id] and result["format"] == "otlp-json"
    assert _rows(pg_empty_dsn, run_id) == _rows(pg_dsn, run_id)
    lines = tmp_path / "marked.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + (json.dumps(whole) + "\n" + json.dumps(whole)).encode())
    assert _import(pg_empty_dsn, lines)["duplicates"] == 2 * result["events_inserted"]


def test_import_leaves_out_agentcap_pb_span_envelopes_no_trace_can_hold(
    demo_log, pg_empty_dsn, tmp_path
):
    """agentcap-pb span envelopes whose ids are not lower-case hex trace and span ids, or whose
    kind or status code OpenTelemetry does not have, are left out with a warning, counted as
    rejected (status 1), and the rest is stored: stored, they made an otlp-json export that
    import refuses ('zz' as a parent span id) or that exports again to other bytes (kind 99)."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", whole)
    edits = {
        "span_id": {"span_id": "zz"},
        "trace_id": {"trace_id": "AB" * 16},
        "parent": {"parent_span_id": "12345"},
        "kind": {"kind": 99},
        "status": {"status_code": 7},
    }
    for name, change in edits.items():
        path = _edited_pb(
            whole,
            tmp_path / f"{name}.pb",
            lambda s, change=change: replace(
                s, spans=(replace(s.spans[-1], **change), *s.spans[:-1])
            ),
        )
        done = _cli("import", str(path), "--dsn", pg_empty_dsn, "--json")
        assert done.returncode == 1, (name, done.stderr.decode())
        assert json.loads(done.stdout)["rejected"] == 1, name
        assert b"span envelope" in done.stderr, name
    assert _import(pg_empty_dsn, whole)["rejected"] == 0  # the span left out each time
    assert _rows(pg_empty_dsn, run_id) == _rows(pg_dsn, run_id)
    again = _export(pg_empty_dsn, run_id, "otlp-json", tmp_path / "again.json")
    assert again == _export(pg_dsn, run_id, "otlp-json", tmp_path / "first.json")


def test_trace_exports_leave_out_events_whose_ids_no_trace_can_hold(pg_dsn, pg_empty_dsn, tmp_path):
    """Events stored (by hand-built batches) with trace or span ids that are not hex trace and
    span ids, a run record with such a root span, and a span envelope's parent of that kind are
    left out of the otlp-json and
    jaeger-json exports, as events without a span id are: the otlp-json export imports and
    exports again to the same bytes, and no 'zz' reaches Jaeger."""
    run_id = "odd-ids"
    now = datetime.now(UTC)
    keys = ["a", "b", "c"]
    ids = [event_id_for(run_id, "lead", key) for key in keys]
    odd = [("t" * 32, "zz" * 8), ("ab" * 16, "zz"), ("cd" * 16, "ef" * 8)]
    events = tuple(
        Event(
            ids[i],
            run_id,
            "lead",
            i,
            "memory_write",
            keys[i],
            now,
            (ids[i - 1],) if i else (),
            {"i": i},
            trace,
            span,
        )
        for i, (trace, span) in enumerate(odd)
    )
    database = Database(pg_dsn)
    writer = EventWriter(database.pool)
    try:
        run = RunRecord(run_id, now, {}, "not a trace id", "zz")
        envelope = SpanRecord(
            run_id, "cd" * 16, "ef" * 8, "zz", "op", 0, now, now, 0, None, None, None
        )
        batch = Batch(events=events, runs=(run,), spans=(envelope,))
        assert writer.write(batch).inserted == 3
    finally:
        writer.close()
        database.close()
    first = _export(pg_dsn, run_id, "otlp-json", tmp_path / "first.json")
    assert b"zz" not in first and b"not a trace id" not in first
    assert b"zz" not in _export(pg_dsn, run_id, "jaeger-json", tmp_path / "jaeger.json")
    result = _import(pg_empty_dsn, tmp_path / "first.json")
    assert result["events_inserted"] == 1 and result["rejected"] == 0
    assert _export(pg_empty_dsn, run_id, "otlp-json", tmp_path / "second.json") == first


def test_import_leaves_out_agentcap_pb_conflict_rows_the_log_cannot_hold(
    demo_log, pg_empty_dsn, tmp_path
):
    """agentcap-pb conflict rows with a reason the log does not know or ids that are not UUIDs
    are left out with a warning and counted as rejected (status 1), before anything is written:
    the run is stored in full and the valid conflict row with it, where they made the write of
    the conflicts fail after the run was stored."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", whole)
    (snapshot,) = agentcap_pb.loads(whole.read_bytes())
    event = snapshot.events[0]
    other = replace(snapshot.events[1], payload_json='{"other": 1}')

    def conflict(reason: str, existing: str | None, row: Any) -> ConflictRow:
        return ConflictRow(reason, existing, event.wall_time_us, "digest-" + reason, row)

    conflicts = (
        conflict("run_agent_seq", event.event_id, other),
        conflict("no such reason", event.event_id, other),
        conflict("run_agent_key", "nope", other),
        conflict("event_id_content", event.event_id, replace(other, causal_parent_ids=("x",))),
    )
    path = _edited_pb(whole, tmp_path / "conflicts.pb", lambda s: replace(s, conflicts=conflicts))
    done = _cli("import", str(path), "--dsn", pg_empty_dsn, "--json")
    assert done.returncode == 1, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["rejected"] == 3 and result["conflicts_imported"] == 1, result
    assert b"conflict row" in done.stderr
    stored = _rows(pg_empty_dsn, run_id)
    assert len(stored["events"]) == len(snapshot.events) and len(stored["conflicts"]) == 1


def test_the_conflict_reasons_import_admits_are_the_logs(pg_dsn):
    """The conflict reasons import checks rows against are exactly those agentcap.conflicts'
    CHECK constraint admits (a migration that adds one must add it here too)."""
    import re

    from otel_agentcap.transfer.load import _CONFLICT_REASONS

    with psycopg.connect(pg_dsn) as conn:
        definitions = [
            row[0]
            for row in conn.execute(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
                " WHERE conrelid = 'agentcap.conflicts'::regclass AND contype = 'c'"
            )
        ]
    (reasons,) = [d for d in definitions if "reason" in d]
    assert set(re.findall(r"'([a-z_]+)'", reasons)) == _CONFLICT_REASONS


def test_import_stores_an_agentcap_pb_payload_that_is_not_json_as_a_marker(
    demo_log, pg_empty_dsn, tmp_path
):
    """An agentcap-pb event payload (or conflict row payload) that is not JSON is stored as an
    ``$agentcap.unparsed`` marker holding its text, as the OTLP ingest stores it, and the rest of
    the batch is stored; the import counts it (--json, the summary) and warns, status 0."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", whole)
    (snapshot,) = agentcap_pb.loads(whole.read_bytes())
    event = snapshot.events[0]
    aside = replace(event, payload_json="{not json either")
    conflict = ConflictRow("run_agent_seq", event.event_id, event.wall_time_us, "d", aside)
    edited = _edited_pb(
        whole,
        tmp_path / "edited.pb",
        lambda s: replace(
            s,
            events=(replace(s.events[0], payload_json='{"cut": "by a li'), *s.events[1:]),
            conflicts=(conflict,),
        ),
    )
    done = _cli("import", str(edited), "--dsn", pg_empty_dsn, "--json")
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["events_inserted"] == len(snapshot.events) and result["rejected"] == 0
    assert result["unparsed_payloads"] == 2 and result["conflicts_imported"] == 1
    assert b"not JSON" in done.stderr, done.stderr.decode()
    with psycopg.connect(pg_empty_dsn) as conn:
        payloads = dict(
            conn.execute(
                "SELECT event_id::text, payload FROM agentcap.events WHERE run_id = %s", (run_id,)
            ).fetchall()
        )
        kept = conn.execute(
            "SELECT payload FROM agentcap.conflicts WHERE run_id = %s", (run_id,)
        ).fetchone()[0]
    assert payloads[event.event_id] == {"$agentcap.unparsed": '{"cut": "by a li'}
    assert kept == {"$agentcap.unparsed": "{not json either"}
    assert {k: v for k, v in payloads.items() if k != event.event_id} == {
        e.event_id: json.loads(e.payload_json) for e in snapshot.events[1:]
    }
    again = _cli("import", str(edited), "--dsn", pg_empty_dsn)
    assert again.returncode == 0, again.stderr.decode()
    assert b"2 payloads not JSON" in again.stdout, again.stdout.decode()


def test_import_of_otlp_json_keeps_and_counts_markers_as_agentcap_pb_does(
    demo_log, pg_empty_dsn, tmp_path
):
    """An OTLP/JSON file whose declared run attributes are not a JSON object, and one of whose
    payloads is not JSON, is stored with ``$agentcap.unparsed`` markers holding their text (the
    attributes were dropped for ``{}``), counted (--json, the summary) and warned about, as an
    agentcap-pb file is."""
    pg_dsn = demo_log.dsn
    run_id, document = _demo_otlp(demo_log, tmp_path)
    declared, cut = '[1, "two"]', '{"cut": "by a li'
    spans = [
        span
        for resource in document["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]
    (root,) = [s for s in spans if any(a["key"] == "agentcap.run.root" for a in s["attributes"])]
    root["attributes"].append(
        {"key": "agentcap.run.attributes", "value": {"stringValue": declared}}
    )
    payload = next(
        a
        for s in spans
        for a in s["attributes"]
        if a["key"] == "agentcap.event.payload" and "memory_write" in s["name"]
    )
    payload["value"] = {"stringValue": cut}
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    done = _cli("import", str(edited), "--dsn", pg_empty_dsn, "--json")
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert (result["unparsed_attributes"], result["unparsed_payloads"]) == (1, 1)
    assert result["rejected"] == 0
    assert b"not a JSON object" in done.stderr and b"not JSON" in done.stderr
    with psycopg.connect(pg_empty_dsn) as conn:
        (attributes,) = conn.execute(
            "SELECT attributes FROM agentcap.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
        marked = conn.execute(
            "SELECT count(*) FROM agentcap.events WHERE run_id = %s AND payload = %s::jsonb",
            (run_id, json.dumps({"$agentcap.unparsed": cut})),
        ).fetchone()[0]
    assert attributes == {"$agentcap.unparsed": declared}
    assert marked == 1
    assert _event_count(pg_empty_dsn) == _event_count(pg_dsn)


def test_import_keeps_agentcap_pb_run_attributes_that_are_not_an_object_in_a_marker(
    demo_log, pg_empty_dsn, tmp_path
):
    """agentcap-pb run attributes that are not a JSON object (a list, a string, a number, text
    that is not JSON) are stored as ``{"$agentcap.unparsed": text}`` holding their exact text,
    counted (--json, the summary) and warned about: never replaced by ``{}`` in silence."""
    pg_dsn, run_id = demo_log.dsn, demo_log.run_id
    whole = tmp_path / "run.pb"
    _export(pg_dsn, run_id, "agentcap-pb", whole)
    for number, text in enumerate(['[1, "two"]', '"a text"', "42", '{"cut": "by a li']):
        stored_id = f"attributes-{number}"
        target = _edited_pb(
            whole,
            tmp_path / f"{stored_id}.pb",
            lambda s, run=stored_id, text=text: replace(
                s,
                run=replace(s.run, run_id=run, attributes_json=text),
                agents=(),
                spans=(),
                events=(),
                conflicts=(),
            ),
        )
        done = _cli("import", str(target), "--dsn", pg_empty_dsn, "--json")
        assert done.returncode == 0, done.stderr.decode()
        with psycopg.connect(pg_empty_dsn) as conn:
            (stored,) = conn.execute(
                "SELECT attributes FROM agentcap.runs WHERE run_id = %s", (stored_id,)
            ).fetchone()
        assert stored == {"$agentcap.unparsed": text}, text
        assert json.loads(done.stdout)["unparsed_attributes"] == 1, text
        assert b"not a JSON object" in done.stderr, done.stderr.decode()
    done = _cli("import", str(target), "--dsn", pg_empty_dsn)
    assert b"1 run attributes not a JSON object" in done.stdout, done.stdout.decode()


def test_an_otlp_protobuf_span_with_a_malformed_parent_span_id_is_left_out_and_counted(
    pg_dsn, tmp_path
):
    """Importing an OTLP protobuf file whose event span has a 100-byte parent span id leaves that
    span out, counted as rejected and named in the warning (exit 1), rather than storing it as a
    root span with its parent dropped; the file's other spans are stored."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from otlp_support import captured

    spans, expected = captured("run-bad-parent")
    request = encode_spans(spans)
    [child] = [
        s
        for r in request.resource_spans
        for scope in r.scope_spans
        for s in scope.spans
        if s.name == "memory_write"
    ]
    child.parent_span_id = b"\1" * 100
    path = tmp_path / "run.otlp"
    path.write_bytes(request.SerializeToString())
    done = _cli("import", str(path), "--dsn", pg_dsn, "--json")
    assert done.returncode == 1, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["rejected"] == 1
    assert b"parent span id is 100 bytes, not 8" in done.stderr
    assert 0 < result["events_inserted"] < expected
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM agentcap.spans WHERE name = 'memory_write'")
        assert row.fetchone() == (0,)


def _big_run(dsn: str, run_id: str, *, agents: int, spans: int, events: int) -> None:
    """A hand-built run with more agents, span envelopes and events than one batch holds: each
    event in a span of its own (the first ``spans`` events), agents taking turns."""
    started = datetime(2026, 1, 5, tzinfo=UTC)
    trace_id = "ab" * 16
    names = [f"agent-{n:05d}" for n in range(agents)]
    seqs = dict.fromkeys(names, 0)
    rows: list[Event] = []
    for n in range(events):
        agent = names[n % agents]
        seqs[agent] += 1
        key = f"k{n}"
        rows.append(
            Event(
                event_id_for(run_id, agent, key),
                run_id,
                agent,
                seqs[agent],
                "memory_write",
                key,
                started + timedelta(microseconds=n),
                payload={"n": n, "text": "x" * (n % 50)},
                trace_id=trace_id if n < spans else None,
                span_id=f"{n + 1:016x}" if n < spans else None,
            )
        )
    head = Batch(
        events=tuple(rows[:500]),
        agents=tuple(AgentRecord(run_id, name, name, lineage_known=True) for name in names),
        runs=(RunRecord(run_id, started, {"size": events}, trace_id, f"{0:016x}"),),
        spans=tuple(
            SpanRecord(
                run_id,
                trace_id,
                f"{n + 1:016x}",
                None,
                f"op {n}",
                0,
                started + timedelta(microseconds=n),
                started + timedelta(microseconds=n + 1),
            )
            for n in range(spans)
        ),
    )
    database = Database(dsn)
    writer = EventWriter(database.pool)
    try:
        writer.write(head)
        for start in range(500, len(rows), 500):
            writer.write(Batch(events=tuple(rows[start : start + 500])))
    finally:
        writer.close()
        database.close()


def _messages(data: bytes) -> list[Any]:
    return list(agentcap_pb.read_batches(data))


def test_streamed_agentcap_pb_export_gives_the_bytes_of_the_whole_run(demo_log, pg_dsn):
    """agentcap-pb written batch by batch from the log's cursors is, byte for byte, the export
    built from the whole run in memory: for the demo run and a run with every event type (and a
    conflict row); both put every agent and span envelope in the first message, as earlier
    versions did, when a run has at most 1,000 of each."""
    _stored_run(pg_dsn, "every-type")
    for dsn, run_id in ((demo_log.dsn, demo_log.run_id), (pg_dsn, "every-type")):
        with psycopg.connect(dsn) as conn:
            whole = agentcap_pb.dumps(load_run(conn, run_id))
            streamed = io.BytesIO()
            size = export_run_to(
                conn, run_id, "agentcap-pb", lambda s=streamed: cast(BinaryIO, _Unclosed(s))
            )
        assert streamed.getvalue() == whole and size == len(whole)
        snapshot = agentcap_pb.loads(whole)[0]
        first = _messages(whole)[0]
        assert len(first.agents) == len(snapshot.agents) > 0
        assert len(first.spans) == len(snapshot.spans) > 0


@pytest.mark.parametrize("fmt", ["otlp-json", "jaeger-json"])
def test_trace_exports_written_a_span_at_a_time_are_the_whole_documents(demo_log, pg_dsn, fmt):
    """otlp-json and jaeger-json written to the file a span at a time are, byte for byte, the
    documents built whole: for the demo run and a run with every event type."""
    _stored_run(pg_dsn, "every-type")
    for dsn, run_id in ((demo_log.dsn, demo_log.run_id), (pg_dsn, "every-type")):
        with psycopg.connect(dsn) as conn:
            whole = export_run(conn, run_id, fmt)
            streamed = io.BytesIO()
            size = export_run_to(conn, run_id, fmt, lambda s=streamed: cast(BinaryIO, _Unclosed(s)))
        assert streamed.getvalue() == whole and size == len(whole)
        assert json.loads(whole)


class _Unclosed(io.RawIOBase):
    """A ``BytesIO`` that a ``with`` block does not close."""

    def __init__(self, target: io.BytesIO) -> None:
        super().__init__()
        self.target = target

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self.target.write(data)


def test_agentcap_pb_export_of_a_big_run_is_written_while_its_rows_are_read(
    pg_dsn, pg_empty_dsn, tmp_path
):
    """The agentcap-pb export of a run of several batches of each kind (2,500 agents, 3,500 span
    envelopes, 4,500 events) writes each batch while the server-side cursor of its rows is still
    open, holding no more events than a batch; the file has the messages its header counts, each
    of at most 1,000 rows, and imports into an empty log and exports again to the same bytes
    and rows, through the command line as through a file given to ``import_file``."""
    run_id = "big"
    _big_run(pg_dsn, run_id, agents=2500, spans=3500, events=4500)
    seen: list[tuple[int, list[str]]] = []

    class Watching(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            cursors = [r[0] for r in conn.execute("SELECT name FROM pg_cursors ORDER BY name")]
            seen.append((len(data), cursors))
            out.write(data)
            return len(data)

    out = io.BytesIO()
    with psycopg.connect(pg_dsn) as conn:
        export_run_to(conn, run_id, "agentcap-pb", lambda: cast(BinaryIO, Watching()))
    data = out.getvalue()
    messages = _messages(data)
    assert len(messages) == len(seen) == messages[0].header.batches == 1 + 2 + 3 + 5
    kinds = [
        [kind for kind in ("agents", "spans", "events") if len(getattr(m, kind))] for m in messages
    ]
    assert kinds == [["agents", "spans"]] + [["agents"]] * 2 + [["spans"]] * 3 + [["events"]] * 5
    assert all(max(len(m.agents), len(m.spans), len(m.events)) <= 1000 for m in messages)
    # Each full batch went out while the cursor of its rows was open with rows left to read (the
    # last, short batch of a kind is built once its cursor ran out).
    assert all("agentcap_export_events" in cursors for _, cursors in seen[6:10])
    assert all("agentcap_export_spans" in cursors for _, cursors in seen[:5])
    assert "agentcap_export_events" not in seen[10][1]
    with psycopg.connect(pg_dsn) as conn:
        assert agentcap_pb.dumps(load_run(conn, run_id)) == data

    path = tmp_path / "big.pb"
    assert _export(pg_dsn, run_id, "agentcap-pb", path) == data
    result = _import(pg_empty_dsn, path)
    assert result["events_inserted"] == 4500 and result["rejected"] == 0
    assert _export(pg_empty_dsn, run_id, "agentcap-pb", tmp_path / "again.pb") == data
    assert _rows(pg_empty_dsn, run_id) == _rows(pg_dsn, run_id)


class _Reads(io.BytesIO):
    """A file that remembers the largest read asked of it."""

    largest = 0

    def read(self, size: int | None = -1) -> bytes:
        self.largest = max(self.largest, sys.maxsize if size is None or size < 0 else size)
        return super().read(size)


def test_agentcap_pb_import_reads_a_message_at_a_time(pg_dsn, pg_empty_dsn, monkeypatch):
    """Importing an agentcap-pb file of many messages reads it in pieces no larger than its
    largest message (never whole), writes a write's worth of rows at a time, and counts what
    the whole-file reading counted; a second import counts every event as a duplicate."""
    run_id = "big"
    _big_run(pg_dsn, run_id, agents=30, spans=1200, events=3300)
    with psycopg.connect(pg_dsn) as conn:
        data = export_run(conn, run_id, "agentcap-pb")
    largest = max(len(m.SerializeToString()) for m in _messages(data))
    writes: list[int] = []
    original = EventWriter.write

    def counted(self: EventWriter, batch: Batch) -> Any:
        writes.append(len(batch.events) + len(batch.spans) + len(batch.agents))
        return original(self, batch)

    monkeypatch.setattr(EventWriter, "write", counted)
    monkeypatch.setattr(load, "EVENTS_PER_WRITE", 1000)
    migrate(pg_empty_dsn)
    database = Database(pg_empty_dsn)
    try:
        source = _Reads(data)
        result = load.import_stream(database, source)
        assert 0 < source.largest <= largest
        again = load.import_file(database, data)
    finally:
        database.close()
    assert result.runs == [run_id] and result.events_inserted == 3300 and result.rejected == 0
    assert again.duplicates == 3300 and again.events_inserted == 0
    assert max(writes) <= 1000 + 1200 + 30 and len(writes) == 2 * 4
    assert _rows(pg_empty_dsn, run_id) == _rows(pg_dsn, run_id)


def test_import_of_an_agentcap_pb_file_corrupt_or_cut_in_a_late_message_stores_nothing(
    pg_dsn, pg_empty_dsn, tmp_path
):
    """An agentcap-pb file of many messages cut inside its last message, or with a byte of its
    last message's framing made wrong, is the one-line error naming what is wrong and stores
    nothing (the whole file is checked before the first write); the file whole, given on
    standard input, imports."""
    run_id = "big"
    _big_run(pg_dsn, run_id, agents=3, spans=10, events=2500)
    whole = _export(pg_dsn, run_id, "agentcap-pb", tmp_path / "big.pb")
    ends = []
    position = 0
    while position < len(whole):
        size, position = agentcap_pb._read_varint(whole, position)
        position += size
        ends.append(position)
    assert len(ends) == 4
    cut = tmp_path / "cut.pb"
    cut.write_bytes(whole[: ends[-1] - 10])
    assert "truncated agentcap-pb stream (in a message)" in _import_error(pg_empty_dsn, cut)
    corrupt = bytearray(whole)
    corrupt[ends[-2] + 3] = 0xFF  # inside the last message: a field with no wire type
    bad = tmp_path / "bad.pb"
    bad.write_bytes(bytes(corrupt))
    assert "undecodable agentcap-pb message" in _import_error(pg_empty_dsn, bad)
    assert _event_count(pg_empty_dsn) == 0
    done = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", "import", "-", "--dsn", pg_empty_dsn, "--json"],
        input=whole,
        capture_output=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["events_inserted"] == 2500
