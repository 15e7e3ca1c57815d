"""The PostgreSQL span exporter over real captured spans and a real PostgreSQL."""

from __future__ import annotations

import time

import psycopg
import pytest
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.export import SpanExportResult

import otel_agentcap as ac
from otel_agentcap.exporters.postgres import PostgresSpanExporter
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
    exporter = PostgresSpanExporter(pg_dsn)
    try:
        assert exporter.export(captured.spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
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


def test_export_runs_with_instrumentation_suppressed(pg_dsn, monkeypatch):
    """The exporter's own database I/O happens with instrumentation suppressed."""
    with capture_events() as captured:
        _program("run-suppressed")
    exporter = PostgresSpanExporter(pg_dsn)
    seen: list[object] = []
    original = exporter._writer.write

    def spy(batch):
        seen.append(otel_context.get_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY))
        return original(batch)

    monkeypatch.setattr(exporter._writer, "write", spy)
    try:
        assert exporter.export(captured.spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert seen == [True]
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


def test_unstamped_spans_are_ignored(pg_dsn):
    """Spans started outside any agent carry no event and store nothing."""
    from opentelemetry import trace

    with capture_events() as captured, trace.get_tracer("test").start_as_current_span("plain"):
        pass
    exporter = PostgresSpanExporter(pg_dsn)
    try:
        assert exporter.export(captured.spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events") == 0


def test_payload_cut_by_a_length_limit_is_stored_safely_with_the_rest(pg_dsn):
    """A payload attribute that is no longer JSON (cut by an attribute length limit) does not
    fail the batch: it is stored as $agentcap.unparsed and every other event lands."""
    from opentelemetry.sdk.trace import ReadableSpan

    from otel_agentcap import attributes as attr

    with capture_events() as captured:
        _program("run-cut")
    spans = list(captured.spans)
    victim = next(s for s in spans if (s.attributes or {}).get(attr.EVENT_TYPE) == "memory_write")
    cut = dict(victim.attributes or {})
    cut[attr.EVENT_PAYLOAD] = str(cut[attr.EVENT_PAYLOAD])[:15]
    spans[spans.index(victim)] = ReadableSpan(
        name=victim.name,
        context=victim.context,
        parent=victim.parent,
        attributes=cut,
        events=victim.events,
        start_time=victim.start_time,
        end_time=victim.end_time,
        instrumentation_scope=victim.instrumentation_scope,
    )
    exporter = PostgresSpanExporter(pg_dsn)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert _count(pg_dsn, "SELECT count(*) FROM agentcap.events WHERE run_id = 'run-cut'") == len(
        captured.events
    )
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT payload FROM agentcap.events WHERE run_id = 'run-cut' "
            "AND event_type = 'memory_write'"
        ).fetchone()
    assert row is not None and "$agentcap.unparsed" in row[0]
