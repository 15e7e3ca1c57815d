"""One model call is one event: the rule (pipeline.call_identity) and every step that applies it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.jsonsafe import RawJson
from otel_agentcap.pipeline.call_identity import (
    BY_REQUEST_ID,
    BY_RESPONSE_ID,
    SUPERSEDED,
    CallIndex,
    call_ids,
    conflict_reason,
    replaces,
)
from otel_agentcap.testing import capture_events

SDK = "com.anthropic.sdk.python"
ADDON = "opentelemetry.instrumentation.anthropic"


def test_call_ids_count_string_ids_only():
    """A call's ids are the payload's response and request ids as the log's indexes see them:
    strings, values stored as JSON strings, and JSON text read the same way; nothing else."""
    assert call_ids({"response_id": "msg_1", "request_id": "req_1"}) == ("msg_1", "req_1")
    assert call_ids({"request_id": "req_1"}) == (None, "req_1")
    assert call_ids(RawJson('{"response_id": "msg_1"}')) == ("msg_1", None)
    u = uuid.uuid4()
    assert call_ids({"response_id": u, "request_id": 7}) == (str(u), None)
    assert call_ids(["msg_1"]) == (None, None)
    assert call_ids(RawJson("{not json")) == (None, None)


def test_only_the_sdks_record_replaces_another():
    """Of two records of one call the SDK's own is kept; otherwise the kept one stays."""
    assert replaces(True, False)
    assert not replaces(False, True)
    assert not replaces(True, True)
    assert not replaces(False, False)


def test_a_record_is_a_conflict_under_the_id_it_shares():
    """The reason names the response id when the record has one, else the request id."""
    assert conflict_reason("msg_1") == BY_RESPONSE_ID
    assert conflict_reason(None) == BY_REQUEST_ID


def test_call_index_finds_by_response_id_first_and_lends_ids():
    """A call is found by its response id before its request id, per run; what is recorded first
    stays; a record matched by one id lends the call its other id."""
    calls: CallIndex[str] = CallIndex()
    assert calls.find("r", "msg_1", "req_1") is None
    calls.add("r", "msg_1", None, "first")
    assert calls.find("r", "msg_1", "req_9") == ("first", BY_RESPONSE_ID)
    assert calls.find("other-run", "msg_1", None) is None
    found = calls.find("r", "msg_1", "req_1")
    assert found is not None
    calls.add("r", "msg_1", "req_1", found[0])  # the record of "first" lends it req_1
    assert calls.find("r", None, "req_1") == ("first", BY_REQUEST_ID)
    calls.add("r", "msg_2", "req_2", "third")
    assert calls.matches("r", "msg_2", "req_1") == ("third", "first")
    assert calls.find("r", "msg_2", "req_1") == ("third", BY_RESPONSE_ID)


@contextmanager
def _chat(scope: str, response_id: str | None, request_id: str) -> Iterator[None]:
    """A model-call span of the instrumentation ``scope``; the ids arrive with the response."""
    tracer = trace.get_tracer(scope)
    with tracer.start_as_current_span(
        "chat m", attributes={attr.GEN_AI_OPERATION_NAME: "chat"}
    ) as span:
        yield
        if response_id is not None:
            span.set_attribute(attr.GEN_AI_RESPONSE_ID, response_id)
        span.set_attribute("anthropic.request.id", request_id)


def _record_calls(run_id: str) -> list[ReadableSpan]:
    """Four calls, recorded as instrumentations record them: A by an add-on's span with the SDK's
    span inside it, B by an add-on's span and then the SDK's, C (an error response: a request id
    only) the same way, D by the SDK in two agents (a call recorded again elsewhere)."""
    with capture_events() as captured, oa.run(run_id):
        with oa.agent("a"):
            with _chat(ADDON, "msg_A", "req_A"), _chat(SDK, "msg_A", "req_A"):
                pass
            for call_id, response_id in (("B", "msg_B"), ("C", None)):
                for scope in (ADDON, SDK):
                    with _chat(scope, response_id, f"req_{call_id}"):
                        pass
            with _chat(SDK, "msg_D", "req_D"):
                pass
        with oa.agent("b"), _chat(SDK, "msg_D", "req_D"):
            pass
    return captured.spans


def _call_of(span: ReadableSpan) -> str | None:
    """The test's name of the call a model-call span records (A to D), None for other spans."""
    attributes = span.attributes or {}
    if attributes.get(attr.EVENT_TYPE) != "model_call":
        return None
    request_id = attributes.get("anthropic.request.id")
    return str(request_id).removeprefix("req_") if request_id else None


def test_processor_gives_nested_spans_of_a_call_one_event():
    """While the spans run, a model-call span started inside another span of the same call takes
    its stamp, and the add-on's span is marked superseded; spans that did not overlap are not
    joined there (the mapping and the log take over)."""
    spans = _record_calls("run-processor")
    by_call: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        call = _call_of(span)
        if call is not None:
            by_call.setdefault(call, []).append(span)
    [outer, inner] = sorted(by_call["A"], key=lambda s: s.instrumentation_scope.name != ADDON)
    assert outer.attributes[attr.EVENT_ID] == inner.attributes[attr.EVENT_ID]
    assert outer.attributes.get(SUPERSEDED) is True
    assert not inner.attributes.get(SUPERSEDED)
    for call in "BCD":
        assert len({s.attributes[attr.EVENT_ID] for s in by_call[call]}) == 2


def _stored(dsn: str, run_id: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    with psycopg.connect(dsn) as conn:
        events = conn.execute(
            "SELECT event_id::text, coalesce(payload->>'request_id', ''),"
            " payload->>'instrumentation' FROM agentcap.events"
            " WHERE run_id = %s AND event_type = 'model_call'",
            (run_id,),
        ).fetchall()
        conflicts = conn.execute(
            "SELECT event_id::text, reason, existing_event_id::text FROM agentcap.conflicts"
            " WHERE run_id = %s",
            (run_id,),
        ).fetchall()
    return [tuple(r) for r in events], [tuple(r) for r in conflicts]


@pytest.fixture()
def exporter(pg_dsn: str) -> Iterator[PostgresSpanExporter]:
    exporter = PostgresSpanExporter(pg_dsn)
    yield exporter
    exporter.shutdown()


@pytest.mark.storage
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_one_model_call_is_one_event_end_to_end(
    pg_dsn: str, exporter: PostgresSpanExporter, data: Any
) -> None:
    """The spans of four calls, exported in any split and order, some batches twice: the log holds
    one model_call event per call; every other record of a call is a conflict naming that event,
    under the id it shares. The event kept comes from the first batch that held a record of the
    call (the first writer wins); of an agent's records in that batch, the SDK's, else the first
    (records of several agents are written in parallel: any of them). A second event of a stored
    call is refused by the database itself."""
    run_id = f"run-{uuid.uuid4()}"
    spans: Sequence[ReadableSpan] = data.draw(st.permutations(_record_calls(run_id)))
    cuts = data.draw(st.lists(st.booleans(), min_size=len(spans), max_size=len(spans)))
    batches: list[list[ReadableSpan]] = [[]]
    for span, cut in zip(spans, cuts, strict=True):
        batches[-1].append(span)
        if cut:
            batches.append([])
    batches = [b for b in batches if b]
    again = data.draw(st.lists(st.sampled_from(range(len(batches))), max_size=3))
    for batch in [*batches, *(batches[i] for i in again)]:
        assert exporter.export(batch) is SpanExportResult.SUCCESS

    # Each call's records by event id: (batch, position in the export, agent, the SDK's?).
    records: dict[str, dict[str, tuple[int, int, str, bool]]] = {}
    for position, span in enumerate(s for b in batches for s in b):
        call = _call_of(span)
        attributes = span.attributes or {}
        if call is None or attributes.get(SUPERSEDED):
            continue
        batch_index = next(i for i, b in enumerate(batches) if span in b)
        sdk = span.instrumentation_scope.name == SDK
        records.setdefault(call, {})[str(attributes[attr.EVENT_ID])] = (
            batch_index,
            position,
            str(attributes[attr.AGENT_ID]),
            sdk,
        )

    events, conflicts = _stored(pg_dsn, run_id)
    kept = {request.removeprefix("req_"): (event, scope) for event, request, scope in events}
    assert sorted(kept) == ["A", "B", "C", "D"]  # one event per call
    assert len(events) == 4
    expected_conflicts = set()
    for call, of_call in records.items():
        first_batch = min(r[0] for r in of_call.values())
        in_first = {e: r for e, r in of_call.items() if r[0] == first_batch}
        if len({r[2] for r in in_first.values()}) > 1:
            assert kept[call][0] in in_first, call  # one agent's record, written first
            expected = kept[call][0]
        else:
            sdk = [e for e, r in in_first.items() if r[3]]
            if sdk and len(sdk) < len(in_first):
                expected = sdk[0]  # the SDK's record replaces the add-on's in its batch
            else:
                expected = min(in_first, key=lambda e: in_first[e][1])  # the first exported
            assert kept[call][0] == expected, call
        reason = BY_REQUEST_ID if call == "C" else BY_RESPONSE_ID
        expected_conflicts |= {(e, reason, expected) for e in of_call if e != expected}
    assert sorted(conflicts) == sorted(expected_conflicts)  # each once, re-sent or not

    # The backstop: a copy of a stored call under another event id is refused by the indexes.
    with (
        psycopg.connect(pg_dsn) as conn,
        pytest.raises(psycopg.errors.UniqueViolation, match="response_id"),
    ):
        conn.execute(
            "INSERT INTO agentcap.events SELECT (jsonb_populate_record(NULL::agentcap.events,"
            " to_jsonb(e) || jsonb_build_object('event_id', gen_random_uuid(),"
            " 'logical_seq', e.logical_seq + 1000000, 'idempotency_key', 'copy'))).*"
            " FROM agentcap.events e WHERE e.event_id = %s",
            (kept["B"][0],),
        )
