"""The PostgreSQL span exporter over real captured spans and a real PostgreSQL."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode

import otel_agentcap as ac
from otel_agentcap import attributes as attr
from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.exporters.postgres.exporter import ExportStats
from otel_agentcap.model import event_id_for
from otel_agentcap.testing import capture_events

pytestmark = pytest.mark.storage


def _program(run_id: str) -> None:
    memory = ac.Memory("m")

    @ac.tool
    def double(x: int) -> int:
        return 2 * x

    with ac.run(run_id), ac.agent("planner") as planner:
        memory["k"] = 1
        child = planner.spawn("worker", key="w")

        def work() -> None:
            double.invoke("call-1", memory["k"])

        child.run(work)


def _export_once(dsn: str, spans: Sequence[ReadableSpan]) -> ExportStats:
    """Export ``spans`` in one call of a fresh exporter, which must succeed; its stats."""
    exporter = PostgresSpanExporter(dsn)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        return exporter.stats()
    finally:
        exporter.shutdown()


def _count(dsn: str, sql: str, *params: object) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


def test_same_spans_exported_twice_are_stored_once(pg_dsn):
    """Exporting the same spans again (an exporter retry) adds no rows and no conflicts."""
    with capture_events() as captured:
        _program("run-dup")
    exporter = PostgresSpanExporter(pg_dsn)
    try:
        assert exporter.export(captured.spans) is SpanExportResult.SUCCESS
        assert exporter.export(captured.spans) is SpanExportResult.SUCCESS
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    expected = len(captured.events)
    assert (
        _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = %s", "run-dup")
        == expected
    )
    assert stats.events_inserted == expected
    assert stats.duplicates == expected
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == 0


def test_spawn_links_land_as_data(pg_dsn):
    """The child's agent row names its parent and the parent's agent_spawn event."""
    with capture_events() as captured:
        _program("run-links")
    _export_once(pg_dsn, captured.spans)
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            """SELECT a.parent_agent_id, e.agent_id, e.event_type
               FROM agentcap.agents a JOIN agentcap.events e ON e.event_id = a.spawned_at_event_id
               WHERE a.run_id = 'run-links' AND a.agent_id = 'planner/w'"""
        ).fetchone()
        root = conn.execute(
            "SELECT parent_agent_id, spawned_at_event_id FROM agentcap.agents "
            "WHERE run_id = 'run-links' AND agent_id = 'planner'"
        ).fetchone()
    assert row == ("planner", "planner", "agent_spawn")
    assert root == (None, None)


def test_run_attributes_land_in_the_runs_table(pg_dsn):
    """ac.run(run_id, **attributes) stores the attributes with the run, also for an agent run in
    a worker thread and a spawned child."""
    with (
        capture_events() as captured,
        ac.run("run-attrs", user="bob", n=3, tags=["a", "b"]),
        ac.agent("planner") as planner,
    ):
        planner.spawn("worker", key="w").run(lambda: None, timeout=5)
    _export_once(pg_dsn, captured.spans)
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT attributes FROM agentcap.runs WHERE run_id = 'run-attrs'"
        ).fetchone()
    assert row == ({"user": "bob", "n": 3, "tags": ["a", "b"]},)


def test_export_runs_with_instrumentation_suppressed(pg_dsn, monkeypatch):
    """The exporter's own database I/O happens with instrumentation suppressed."""
    with capture_events() as captured:
        _program("run-suppressed")
    from otel_agentcap.exporters.postgres.writer import EventWriter

    exporter = PostgresSpanExporter(pg_dsn)
    seen: list[object] = []
    original = EventWriter.write_prepared

    def spy(self, prepared, **kwargs):
        seen.append(otel_context.get_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY))
        return original(self, prepared, **kwargs)

    monkeypatch.setattr(EventWriter, "write_prepared", spy)
    try:
        assert exporter.export(captured.spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert seen and set(seen) == {True}
    assert otel_context.get_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY) is None


@pytest.mark.fault
def test_unreachable_database_fails_the_batch_without_raising():
    """With the server down, export retries until its deadline, then returns FAILURE and counts."""
    with capture_events() as captured:
        _program("run-down")
    exporter = PostgresSpanExporter(
        "postgresql://postgres@127.0.0.1:1/none?connect_timeout=1", retry_timeout=1.0
    )
    started = time.monotonic()
    try:
        result = exporter.export(captured.spans)
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    assert result is SpanExportResult.FAILURE
    assert time.monotonic() - started < 15
    assert stats.failed_batches == 1
    assert stats.events_failed == len(captured.events)
    assert stats.failed_attempts >= 1


@pytest.mark.fault
def test_a_server_that_never_answers_costs_a_capture_query_its_timeout_only():
    """A server that accepts connections and never answers (a hung host) fails a query on the
    capture path within its timeout, not the 5 s of the schema check."""
    import socket
    import threading

    from otel_agentcap.exporters.postgres import Database
    from otel_agentcap.exporters.postgres.errors import ConnectionFailed

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(server.accept()[0]), daemon=True).start()
    database = Database(f"postgresql://u:p@127.0.0.1:{server.getsockname()[1]}/db")
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionFailed), database.quick_connection(timeout=2.0):
            pass
        elapsed = time.monotonic() - started
    finally:
        database.close()
        server.close()
    assert elapsed < 4.5  # 2 s of connect timeout, well short of the 5 s it used to take


def test_unstamped_spans_are_ignored(pg_dsn):
    """Spans started outside any agent carry no event and store nothing."""
    from opentelemetry import trace

    with capture_events() as captured, trace.get_tracer("test").start_as_current_span("plain"):
        pass
    _export_once(pg_dsn, captured.spans)
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events") == 0


def test_payload_cut_by_a_length_limit_is_stored_safely_with_the_rest(pg_dsn):
    """A payload attribute that is no longer JSON (cut by an attribute length limit) does not
    fail the batch: it is stored as $agentcap.unparsed and every other event lands."""
    from otel_agentcap import attributes as attr
    from otel_agentcap.pipeline.span_copy import copy_with

    with capture_events() as captured:
        _program("run-cut")
    spans = list(captured.spans)
    victim = next(s for s in spans if (s.attributes or {}).get(attr.EVENT_TYPE) == "memory_write")
    cut = dict(victim.attributes or {})
    cut[attr.EVENT_PAYLOAD] = str(cut[attr.EVENT_PAYLOAD])[:15]
    spans[spans.index(victim)] = copy_with(victim, cut)
    _export_once(pg_dsn, spans)
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-cut'") == len(
        captured.events
    )
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT payload FROM agentcap.events WHERE run_id = 'run-cut' "
            "AND event_type = 'memory_write'"
        ).fetchone()
    assert row is not None and "$agentcap.unparsed" in row[0]


def test_a_payload_nested_deeper_than_the_server_parses_is_stored_safely_with_the_rest(pg_dsn):
    """A payload of JSON nested deeper than PostgreSQL parses ("stack depth limit exceeded", an
    OperationalError by its class) is not taken for a broken connection and retried until the
    batch is given up: it is stored as $agentcap.unparsed and every other event lands."""
    from otel_agentcap import attributes as attr
    from otel_agentcap.exporters.postgres import PostgresSpanExporter
    from otel_agentcap.pipeline.span_copy import copy_with

    with capture_events() as captured:
        _program("run-deep")
    spans = list(captured.spans)
    victim = next(s for s in spans if (s.attributes or {}).get(attr.EVENT_TYPE) == "memory_write")
    deep = dict(victim.attributes or {})
    deep[attr.EVENT_PAYLOAD] = "[" * 200_000 + "]" * 200_000
    spans[spans.index(victim)] = copy_with(victim, deep)
    exporter = PostgresSpanExporter(pg_dsn, writers=1)
    try:
        exporter.export(spans)
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    assert stats.failed_attempts == 0 and stats.events_failed == 0
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-deep'") == len(
        captured.events
    )
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT payload FROM agentcap.events WHERE run_id = 'run-deep' "
            "AND event_type = 'memory_write'"
        ).fetchone()
    assert row is not None and "$agentcap.unparsed" in row[0]


def test_a_row_the_server_refuses_costs_only_its_own_span(pg_dsn):
    """A span whose row PostgreSQL refuses (here a trigger refuses its payload) does not take the
    rest of its batch down: the batch is written in halves and only that span's events fail."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            """
            CREATE FUNCTION agentcap.fail_on_poison() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.payload ? 'poison' THEN RAISE EXCEPTION 'poisoned' USING ERRCODE = '23514'; END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER poison BEFORE INSERT ON agentcap.events
                FOR EACH ROW EXECUTE FUNCTION agentcap.fail_on_poison();
            """
        )
    with capture_events() as captured:
        _program("run-poison")
    spans = list(captured.spans)
    victim = spans[len(spans) // 2]
    poisoned = {k: v for k, v in (victim.attributes or {}).items() if k != attr.OUTCOME}
    poisoned[attr.EVENT_ID] = event_id_for("run-poison", str(poisoned[attr.AGENT_ID]), "poison")
    poisoned[attr.EVENT_IDEMPOTENCY_KEY] = "poison"
    poisoned[attr.EVENT_SEQ] = 10_000
    poisoned[attr.EVENT_PAYLOAD] = '{"poison": true}'
    spans.append(
        ReadableSpan(
            name=victim.name,
            context=victim.context,
            parent=victim.parent,
            attributes=poisoned,
            start_time=victim.start_time,
            end_time=victim.end_time,
            instrumentation_scope=victim.instrumentation_scope,
        )
    )
    exporter = PostgresSpanExporter(pg_dsn, retry_timeout=2)
    try:
        assert exporter.export(spans) is SpanExportResult.FAILURE
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    stored = _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-poison'")
    assert stored == len(captured.events)
    assert stats.failed_batches == 1 and stats.events_failed == 1


def test_spans_that_break_a_validation_rule_are_left_out_alone(pg_dsn):
    """Spans with an over-long agent id, a sequence that is not an integer, an event id that is
    not the id of their run, agent and key, or a sequence beyond the accepted range are left out
    and counted; every other span of the batch is stored and the export succeeds."""
    with capture_events() as captured:
        _program("run-invalid")
    spans = list(captured.spans)
    victim = next(s for s in spans if s.name == "memory_write")
    base = {k: v for k, v in (victim.attributes or {}).items() if k != attr.OUTCOME}
    huge_id = secrets.token_hex(4500)
    bad = [
        {
            **base,
            attr.AGENT_ID: huge_id,
            attr.EVENT_ID: event_id_for("run-invalid", huge_id, "k"),
            attr.EVENT_IDEMPOTENCY_KEY: "k",
        },
        {**base, attr.EVENT_SEQ: "12"},
        {
            **base,
            attr.EVENT_ID: event_id_for("other-run", "planner", "k"),
            attr.EVENT_IDEMPOTENCY_KEY: "k",
        },
        {
            **base,
            attr.EVENT_SEQ: 2**63 - 1,
            attr.EVENT_IDEMPOTENCY_KEY: "far",
            attr.EVENT_ID: event_id_for("run-invalid", "planner", "far"),
        },
    ]
    for attributes in bad:
        spans.append(
            ReadableSpan(
                name=victim.name,
                context=victim.context,
                attributes=attributes,
                start_time=victim.start_time,
                end_time=victim.end_time,
            )
        )
    exporter = PostgresSpanExporter(pg_dsn, retry_timeout=2)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    stored = _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-invalid'")
    assert stored == len(captured.events)
    assert stats.spans_rejected == 1  # the sequence that is not an integer: unreadable
    assert stats.events_rejected == 3
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.agents WHERE length(agent_id) > 512") == 0
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == 0


_LIMITED = textwrap.dedent(
    """
    import json, sys
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    import otel_agentcap as ac
    from otel_agentcap.exporters.postgres import PostgresSpanExporter
    from otel_agentcap.exporters.synchronous import SynchronousSpanProcessor
    from otel_agentcap.pipeline.processor import AgentCapSpanProcessor

    # A provider built by hand takes the environment's limits (configure() keeps them off the
    # log's spans).
    exporter = PostgresSpanExporter(sys.argv[1])
    provider = TracerProvider()
    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(SynchronousSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    @ac.tool
    def double(x: int) -> int:
        return 2 * x

    with ac.run("run-limit"), ac.agent("planner"):
        double.invoke("call-1", 1)
    provider.shutdown()
    print(json.dumps(exporter.stats().__dict__))
    """
)


@pytest.mark.multiprocess
def test_closing_events_cut_by_a_length_limit_are_counted_and_logged(pg_dsn):
    """Under OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT=100, on a provider built by hand, a closing
    event's record is cut before its identity: it cannot be stored, and it is counted and logged
    instead of vanishing."""
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, pg_dsn],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "100"},
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    stored = _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-limit'")
    # agent_start and tool_invocation are stored; tool_result and agent_end are counted.
    assert (stored, stats["events_unreadable"]) == (2, 2)
    assert "cannot be read" in done.stderr


SDK_SCOPE = "com.anthropic.sdk.python"
ADDON_SCOPE = "opentelemetry.instrumentation.anthropic"


def _unjoined_model_call(run_id: str, **ids: str) -> dict[str, object]:
    """One model call recorded by an add-on instrumentation and by the SDK, in spans the processor
    could not join at start (the add-on's ended first): two stamps, two event ids. Returns the
    finished spans by scope."""
    from opentelemetry import trace

    from otel_agentcap import attributes as attr

    recorded = {
        k: v
        for k, v in {
            attr.GEN_AI_RESPONSE_ID: ids.get("response_id"),
            "anthropic.request.id": ids.get("request_id"),
        }.items()
        if v is not None
    }
    with capture_events() as captured, ac.run(run_id), ac.agent("planner"):
        for scope in (ADDON_SCOPE, SDK_SCOPE):
            tracer = trace.get_tracer(scope)
            with tracer.start_as_current_span(
                "chat m", attributes={attr.GEN_AI_OPERATION_NAME: "chat"}
            ) as span:
                span.set_attributes(recorded)
    spans = {
        s.instrumentation_scope.name: s
        for s in captured.spans
        if s.name == "chat m" and s.instrumentation_scope is not None
    }
    assert len({(s.attributes or {})[attr.EVENT_ID] for s in spans.values()}) == 2
    return spans


def _conflict_reasons(dsn: str, run_id: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT reason FROM agentcap.conflicts WHERE run_id = %s", (run_id,)
        ).fetchall()
    return [str(r[0]) for r in rows]


def test_model_call_recorded_twice_in_one_export_is_one_event(pg_dsn):
    """Two spans of one call with different event ids in one export: one model_call event (the
    SDK's), the other kept as a conflict and counted."""
    spans = _unjoined_model_call("run-one-batch", response_id="msg_1", request_id="req_1")
    stats = _export_once(pg_dsn, list(spans.values()))
    query = "SELECT count(*) FROM agentcap.events WHERE event_type = 'model_call'"
    assert _count(pg_dsn, query) == 1
    assert _count(pg_dsn, query + " AND payload->>'instrumentation' = %s", SDK_SCOPE) == 1
    assert _conflict_reasons(pg_dsn, "run-one-batch") == ["model_call_response_id"]
    assert stats.conflicts == 1


@pytest.mark.parametrize("first", [SDK_SCOPE, ADDON_SCOPE])
def test_model_call_through_exporter_and_ingest_is_one_event(pg_dsn, first):
    """One record of a call through the exporter, the other through the OTLP ingest (either
    first): one model_call event, one conflict with reason model_call_response_id."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from otel_agentcap.ingest import OtlpIngestServer

    run_id = f"run-paths-{first}"
    spans = _unjoined_model_call(run_id, response_id="msg_1", request_id="req_1")
    later = ADDON_SCOPE if first == SDK_SCOPE else SDK_SCOPE
    _export_once(pg_dsn, [spans[first]])
    with OtlpIngestServer(pg_dsn, port=0) as server:
        result = server.ingest(encode_spans([spans[later]]).SerializeToString())
    assert (result.inserted, result.conflicts) == (0, 1)
    query = "SELECT count(*) FROM agentcap.events WHERE run_id = %s AND event_type = 'model_call'"
    assert _count(pg_dsn, query, run_id) == 1
    assert _conflict_reasons(pg_dsn, run_id) == ["model_call_response_id"]


def test_failed_model_call_recorded_twice_is_one_event_by_request_id(pg_dsn):
    """An error response (no response id) recorded by two spans in two exports: one event, the
    other a conflict found by the request id."""
    spans = _unjoined_model_call("run-error", request_id="req_err")
    exporter = PostgresSpanExporter(pg_dsn)
    try:
        for span in spans.values():
            assert exporter.export([span]) is SpanExportResult.SUCCESS
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-error'") == 1
    assert _conflict_reasons(pg_dsn, "run-error") == ["model_call_request_id"]
    assert (stats.events_inserted, stats.conflicts) == (1, 1)


def _recorded_call(
    run_id: str,
    seq: int,
    scope: str,
    *,
    response_id: str | None = None,
    request_id: str | None = None,
) -> ReadableSpan:
    """A finished model-call span of agent ``a`` recorded by the instrumentation ``scope``."""
    attributes: dict[str, Any] = {
        attr.RUN_ID: run_id,
        attr.AGENT_ID: "a",
        attr.GEN_AI_AGENT_NAME: "a",
        attr.EVENT_ID: event_id_for(run_id, "a", f"seq:{seq}"),
        attr.EVENT_TYPE: "model_call",
        attr.EVENT_SEQ: seq,
        attr.GEN_AI_OPERATION_NAME: "chat",
    }
    if response_id is not None:
        attributes[attr.GEN_AI_RESPONSE_ID] = response_id
    if request_id is not None:
        attributes["anthropic.request.id"] = request_id
    return ReadableSpan(
        name="chat m",
        context=SpanContext(trace_id=0xABC, span_id=seq, is_remote=False),
        attributes=attributes,
        start_time=1_700_000_000_000_000_000 + seq,
        end_time=1_700_000_001_000_000_000,
        status=Status(StatusCode.OK),
        instrumentation_scope=InstrumentationScope(scope),
    )


def test_records_that_meet_only_through_a_third_are_one_event(pg_dsn):
    """Three records of one call in one export: the SDK's has only the request id, the first
    add-on record only the response id, and only the second add-on record has both. The log holds
    one model_call event, the SDK's; both other records are conflicts naming it."""
    run_id = "run-three-records"
    spans = [
        _recorded_call(run_id, 1, ADDON_SCOPE, response_id="msg_1"),
        _recorded_call(run_id, 2, ADDON_SCOPE, response_id="msg_1", request_id="req_1"),
        _recorded_call(run_id, 3, SDK_SCOPE, request_id="req_1"),
    ]
    _export_once(pg_dsn, spans)
    kept = event_id_for(run_id, "a", "seq:3")
    with psycopg.connect(pg_dsn) as conn:
        stored = conn.execute(
            "SELECT event_id::text FROM agentcap.events WHERE run_id = %s", (run_id,)
        ).fetchall()
        conflicts = conn.execute(
            "SELECT event_id::text, existing_event_id::text FROM agentcap.conflicts"
            " WHERE run_id = %s ORDER BY logical_seq",
            (run_id,),
        ).fetchall()
    assert [r[0] for r in stored] == [kept]
    assert conflicts == [
        (event_id_for(run_id, "a", "seq:1"), kept),
        (event_id_for(run_id, "a", "seq:2"), kept),
    ]


def test_spans_of_a_pruned_run_are_counted_as_expired(pg_dsn):
    """Spans of a run that db prune removed (a late redelivery) export successfully, store
    nothing, recreate no run, and are counted in stats().events_expired."""
    from datetime import UTC, datetime

    from psycopg_pool import ConnectionPool

    from otel_agentcap.exporters.postgres import retention
    from otel_agentcap.exporters.postgres.writer import EventWriter
    from otel_agentcap.model import Batch, RunRecord

    # The run is registered with a start in January 2025 before its spans arrive (its first
    # write fixes its start), so its events land in a partition that can be pruned today.
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        writer = EventWriter(pool)
        writer.write(Batch(runs=(RunRecord("run-pruned", datetime(2025, 1, 5, tzinfo=UTC)),)))
        writer.close()
    with capture_events() as captured:
        _program("run-pruned")
    first = _export_once(pg_dsn, captured.spans)
    assert first.events_inserted > 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert retention.prune(conn, datetime(2025, 2, 1, tzinfo=UTC)).runs == 1
    again = _export_once(pg_dsn, captured.spans)
    assert (again.events_inserted, again.events_expired) == (0, first.events_inserted)
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.runs") == 0
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.agents") == 0


def test_later_batches_of_a_run_are_copied_as_built_ahead(pg_dsn, monkeypatch):
    """The first batch of a run is built by its writer once the run's start is read; later
    batches of the run are built ahead with the start the writers share, and that data is what
    the server receives; every row of the run carries the run's start."""
    from otel_agentcap.exporters.postgres import writer as writer_module

    with capture_events() as captured:
        _program("run-ahead")
    spans = list(captured.spans)
    sent: list[tuple[bool, bool]] = []
    original = writer_module.EventWriter.write_prepared

    def spy(self, prepared, **kwargs):
        sent.append((kwargs.get("starts") is not None, kwargs.get("data") is not None))
        return original(self, prepared, **kwargs)

    monkeypatch.setattr(writer_module.EventWriter, "write_prepared", spy)
    exporter = PostgresSpanExporter(pg_dsn, writers=1)
    try:
        half = len(spans) // 2
        assert exporter.export(spans[:half]) is SpanExportResult.SUCCESS
        assert exporter.export(spans[half:]) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert sent[0] == (False, False) and sent[-1] == (True, True)
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT DISTINCT e.run_started_at = r.started_at FROM agentcap.events e"
            " JOIN agentcap.runs r USING (run_id) WHERE run_id = 'run-ahead'"
        ).fetchall()
    assert rows == [(True,)]
