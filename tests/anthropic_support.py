"""Shared fixtures and helpers of the tests/test_anthropic_*.py files."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import anthropic
import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_agentcap import causal_links
from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor
from otel_agentcap.model import Event
from otel_agentcap.testing import InMemoryEventExporter, capture_events
from otel_agentcap.testing.messages_server import MessagesServer

MODEL = "claude-test-model"
API_KEY = "sk-ant-api03-AGENTCAP-NEVER-RECORD-THIS-KEY-0123456789"
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def server() -> Iterator[MessagesServer]:
    with MessagesServer() as srv:
        yield srv


@pytest.fixture
def captured() -> Iterator[InMemoryEventExporter]:
    with capture_events() as sink:
        yield sink


@pytest.fixture
def instrumented() -> Iterator[AnthropicInstrumentor]:
    instrumentor = AnthropicInstrumentor()
    instrumentor.instrument()
    try:
        yield instrumentor
    finally:
        instrumentor.uninstrument()
        causal_links.clear()


@pytest.fixture
def client(
    server: MessagesServer, captured: InMemoryEventExporter
) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0) as cli:
        yield cli


@pytest.fixture
def aclient(server: MessagesServer, captured: InMemoryEventExporter) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def model_calls(sink: InMemoryEventExporter) -> list[Event]:
    gc.collect()
    return sink.of_type("model_call")


def only_model_call(sink: InMemoryEventExporter) -> Event:
    calls = model_calls(sink)
    assert len(calls) == 1, [c.payload for c in calls]
    return calls[0]


class _PostgresSink(InMemoryEventExporter):
    """Collects spans like capture_events and writes each one through the PostgreSQL exporter
    as it ends, as a SimpleSpanProcessor would (the global provider can be set only once)."""

    def __init__(self, exporter: PostgresSpanExporter) -> None:
        super().__init__()
        self.exporter = exporter

    def export(self, spans: Any) -> SpanExportResult:
        super().export(spans)
        spans_list: list[ReadableSpan] = list(spans)
        return self.exporter.export(spans_list)


@pytest.fixture
def stored(pg_dsn: str) -> Iterator[_PostgresSink]:
    """Spans captured inside the test, stored in a fresh PostgreSQL event log as they end."""
    from otel_agentcap.testing._capture import _ensure_installed

    exporter = PostgresSpanExporter(pg_dsn)
    sink = _PostgresSink(exporter)
    fan_out = _ensure_installed()
    fan_out.add(sink)
    try:
        yield sink
    finally:
        fan_out.remove(sink)
        exporter.shutdown()


def stored_events(dsn: str, run_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT event_id::text, agent_id, logical_seq, event_type, "
            "causal_parent_ids::text[], payload FROM agentcap.events WHERE run_id = %s "
            "ORDER BY agent_id, logical_seq",
            (run_id,),
        )
        columns = ["event_id", "agent_id", "seq", "event_type", "parents", "payload"]
        return [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]


def conflict_count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM agentcap.conflicts")
        row = cur.fetchone()
        return int(row[0]) if row else 0
