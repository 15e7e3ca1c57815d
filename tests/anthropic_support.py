"""Fixtures (a pytest plugin, registered in conftest.py) and helpers of the tests that run the
anthropic SDK against the local Messages server."""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import anthropic
import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor, sdk_traces_itself
from otel_agentcap.model import Event
from otel_agentcap.pipeline import causal_links
from otel_agentcap.testing import InMemoryEventExporter, capture_events
from otel_agentcap.testing.messages_server import MessagesServer

MODEL = "claude-test-model"
API_KEY = "sk-ant-api03-AGENTCAP-NEVER-RECORD-THIS-KEY-0123456789"
USER = [{"role": "user", "content": "Hello"}]


def _release(text: str) -> tuple[int, ...]:
    match = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


#: The installed anthropic release, e.g. (2, 15, 0).
ANTHROPIC_RELEASE = _release(version("anthropic"))


def needs_anthropic(*release: int, what: str) -> pytest.MarkDecorator:
    """Skip a test below the anthropic ``release`` that has ``what`` (.ci/floors runs the suite
    at the package's floor, 0.40; the development environment has the newest release)."""
    wanted = ".".join(map(str, release))
    return pytest.mark.skipif(
        release > ANTHROPIC_RELEASE, reason=f"needs anthropic >= {wanted} ({what})"
    )


#: Whether model_call payloads list the tool_use ids a response asked for: on SDKs that trace
#: themselves, only from 2.6 (where the SDK's set_response_attributes hook is; 1.17 to 2.5 have
#: no such hook, and agentcap warns once that the ids are not recorded); on older SDKs the
#: instrumentation's own spans record them.
RECORDS_TOOL_USE_IDS = not sdk_traces_itself() or ANTHROPIC_RELEASE >= (2, 6)


def expected_tool_use_ids(*ids: str) -> list[str]:
    """``ids`` where the installed SDK lets them be recorded (see RECORDS_TOOL_USE_IDS), else []."""
    return list(ids) if RECORDS_TOOL_USE_IDS else []


#: For tests of what an SDK that traces itself records (anthropic 1.17 and later); .ci/floors runs
#: the suite at the package's floor (0.40) too, where these do not apply.
needs_sdk_tracing = pytest.mark.skipif(
    not sdk_traces_itself(), reason="the installed anthropic (before 1.17) does not trace itself"
)


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


def runner_events(sink: InMemoryEventExporter, run_id: str) -> list[dict[str, Any]]:
    """The captured events of ``run_id`` as dicts shaped like :func:`stored_events` rows."""
    return [
        {
            "event_id": e.event_id,
            "agent_id": e.agent_id,
            "seq": e.seq,
            "event_type": e.event_type,
            "parents": list(e.causal_parent_ids),
            "payload": e.payload,
        }
        for e in sink.events
        if e.run_id == run_id
    ]


def check_tool_chain(
    events: list[dict[str, Any]],
    inputs: dict[str, dict[str, Any]] | None = None,
    error_text: str = "no data for X",
) -> None:
    """model_call -> tool_invocation (invocation id = tool_use id) -> tool_result / agent_error
    -> next model_call, for a reply asking for ``toolu_w`` (succeeds) and ``toolu_b`` (fails with
    ``error_text``) with ``inputs`` by tool_use id; events are dicts with event_id, agent_id,
    seq, event_type, parents and payload (as stored)."""
    inputs = inputs or {"toolu_w": {"city": "Oslo"}, "toolu_b": {"city": "X"}}
    by_id = {e["event_id"]: e for e in events}
    calls = sorted((e for e in events if e["event_type"] == "model_call"), key=lambda e: e["seq"])
    assert len(calls) == 2, [c["payload"] for c in calls]
    first, second = calls
    assert first["payload"]["tool_use_ids"] == expected_tool_use_ids("toolu_w", "toolu_b")
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    assert sorted(e["payload"]["invocation_id"] for e in invocations) == ["toolu_b", "toolu_w"]
    for invocation in invocations:
        assert invocation["payload"]["arguments"] == inputs[invocation["payload"]["invocation_id"]]
        assert first["event_id"] in invocation["parents"]
        assert invocation["seq"] > first["seq"]
    outcomes = [e for e in events if e["event_type"] in ("tool_result", "agent_error")]
    assert sorted(e["event_type"] for e in outcomes) == ["agent_error", "tool_result"]
    for outcome in outcomes:
        assert outcome["payload"]["invocation_id"] in ("toolu_w", "toolu_b")
        assert any(by_id[p]["event_type"] == "tool_invocation" for p in outcome["parents"])
    error = next(e for e in outcomes if e["event_type"] == "agent_error")
    assert error["payload"]["invocation_id"] == "toolu_b"
    assert error_text in error["payload"]["message"]
    # The runner's next call names the result of each tool_use (the error event of the broken one).
    assert sorted(second["parents"]) == sorted(e["event_id"] for e in outcomes)
    for outcome in outcomes:
        assert second["seq"] > outcome["seq"]
