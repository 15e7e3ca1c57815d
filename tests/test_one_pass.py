"""one_pass: the rows and COPY data of common spans in one pass, equal to the general path's."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.exporters.durable.records import decode_span, encode_span
from otel_agentcap.exporters.postgres import one_pass as one_pass_module
from otel_agentcap.exporters.postgres.exporter import PostgresSpanExporter, _map
from otel_agentcap.exporters.postgres.one_pass import prepare_spans
from otel_agentcap.exporters.postgres.rows import (
    DEFAULT_MAX_PAYLOAD_CHARS,
    copy_data,
    prepare,
    span_copy_data,
)
from otel_agentcap.model import event_id_for
from otel_agentcap.pipeline.call_identity import SUPERSEDED
from otel_agentcap.pipeline.span_attributes import attributes_of
from otel_agentcap.testing import capture_events

START = datetime(2026, 1, 1, tzinfo=UTC)
NOW_NS = int(datetime.now(UTC).timestamp() * 1e9)
TRACE = 0x0AF7651916CD43DD8448EB211C80319C
SCOPE = InstrumentationScope("otel_agentcap", "0.1.0")
RESOURCE = Resource({"service.name": "svc"})


def _payload(value: Any) -> Any:
    return None if value is None else (type(value.obj), value.obj, value.dumps is not None)


def _comparable(prepared: Any) -> dict[str, Any]:
    """The fields of a PreparedBatch, payloads as what they hold (Jsonb has no equality)."""
    fields = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(prepared)}
    fields["events"] = [(*r[:10], _payload(r[10]), *r[11:]) for r in prepared.events]
    return fields


def _check(
    spans: Sequence[Any],
    *,
    staging: bool = False,
    common: bool | None = None,
    max_chars: int = DEFAULT_MAX_PAYLOAD_CHARS,
) -> None:
    """The one pass gives what the general path gives for ``spans``, or declines (None);
    ``common`` says which is expected."""
    one = prepare_spans(
        spans, staging=staging, known_start=lambda run: START, max_payload_chars=max_chars
    )
    if common is not None:
        assert (one is not None) is common
    if one is None:
        return
    batch = _map(spans, raw_payloads=True)
    general = prepare(batch, max_chars)
    assert _comparable(one.prepared) == _comparable(general)
    assert one.events == len(batch.events) + len(batch.superseded)
    assert not batch.rejected and not batch.unreadable
    starts = {run[0]: START for run in general.runs}
    assert one.starts == starts
    assert one.data == (
        copy_data(general.events, staging=staging, starts=starts) if general.events else None
    )
    assert one.span_data == (
        span_copy_data(general.spans, starts=starts) if general.spans else None
    )


def _captured(run_id: str) -> list[Any]:
    """The spans of a run with every kind of event the capture API records (tools that succeed
    and fail, memory, a spawned child, non-ASCII and NUL in values)."""

    @oa.tool
    def lookup(city: str) -> dict[str, object]:
        if city == "nowhere":
            raise LookupError("no such city \x00 é")
        return {"city": city, "note": "naïve \x00 \ud800"}

    memory = oa.Memory("one-pass")
    with capture_events() as captured, oa.run(run_id), oa.agent("Planner é"):
        memory["ké"] = {"v": "x" * 300, "nul": "\x00"}
        _ = memory.get("ké")
        lookup.invoke("call-1", "Oslo")
        with pytest.raises(LookupError):
            lookup.invoke("call-2", "nowhere")
        child = oa.spawn("worker")
        with child.scope():
            memory["w"] = [1, 2.5, None, "\ud800"]
            lookup.invoke("call-3", "Bergen")
    return list(captured.spans)


def test_captured_spans_give_the_general_paths_rows():
    """Every stamped span of a captured run but the run's root gives the general path's rows,
    COPY data for both paths, in any order; with the root span the general path is taken."""
    spans = _captured(f"one-pass-{uuid.uuid4().hex[:8]}")
    stamped = [s for s in spans if attr.EVENT_ID in attributes_of(s)]
    types = {e.event_type for e in _map(stamped, raw_payloads=True).events}
    assert types >= {
        "agent_start",
        "agent_spawn",
        "agent_end",
        "memory_write",
        "memory_read",
        "tool_invocation",
        "tool_result",
    }
    for staging in (False, True):
        _check(stamped, staging=staging, common=True)
        _check(stamped[::-1], staging=staging, common=True)
    _check(spans, common=False)


def test_spans_read_back_from_the_queue_give_the_same_rows():
    """Spans decoded from their queue records give the rows the general path gives them."""
    spans = _captured(f"one-pass-{uuid.uuid4().hex[:8]}")
    decoded = [decode_span(encode_span(s)) for s in spans if attr.EVENT_ID in attributes_of(s)]
    _check(decoded, common=True)


def test_run_start_unknown_builds_no_copy_data():
    """When a run's stored start is not known, rows are built and COPY data is not."""
    stamped = [s for s in _captured("one-pass-start") if attr.EVENT_ID in attributes_of(s)]
    one = prepare_spans(stamped, staging=False, known_start=lambda run: None)
    assert one is not None and one.prepared.events
    assert (one.data, one.span_data, one.starts) == (None, None, None)


def _span(
    *,
    run: object = "r",
    agent: object = "a",
    seq: object = 1,
    key: object = None,
    event_type: object = "memory_write",
    payload: object = '{"v":1}',
    parents: object = None,
    span_id: int = 1,
    parent: int | None = 0xFFFF,
    trace_id: int = TRACE,
    start: int = NOW_NS,
    end: int | None = NOW_NS + 1000,
    event_id: object = "derived",
    extra: dict[str, Any] | None = None,
    name: str = "memory_write",
    events: Sequence[Event] = (),
) -> ReadableSpan:
    attributes: dict[str, Any] = {
        attr.RUN_ID: run,
        attr.AGENT_ID: agent,
        attr.EVENT_TYPE: event_type,
        attr.EVENT_SEQ: seq,
    }
    if event_id == "derived":
        real_key = key if key is not None else f"seq:{seq}"
        try:
            event_id = event_id_for(run, agent, real_key)  # type: ignore[arg-type]
        except (TypeError, AttributeError, UnicodeEncodeError):
            event_id = str(uuid.uuid4())
    attributes[attr.EVENT_ID] = event_id
    if key is not None:
        attributes[attr.EVENT_IDEMPOTENCY_KEY] = key
    if payload is not None:
        attributes[attr.EVENT_PAYLOAD] = payload
    if parents is not None:
        attributes[attr.EVENT_CAUSAL_PARENT_IDS] = parents
    attributes.update(extra or {})
    return ReadableSpan(
        name=name,
        context=SpanContext(trace_id, span_id, is_remote=False),
        parent=None if parent is None else SpanContext(trace_id, parent, is_remote=False),
        resource=RESOURCE,
        attributes=attributes,
        events=events,
        kind=SpanKind.INTERNAL,
        status=Status(StatusCode.UNSET),
        start_time=start,
        end_time=end,
        instrumentation_scope=SCOPE,
    )


def test_payloads_over_the_limit_are_stored_as_the_general_path_stores_them():
    """Payloads longer than the limit become the same truncation marker on both paths."""
    spans = [
        _span(seq=1, span_id=1, payload='{"v":"' + "x" * 100 + '"}'),
        _span(seq=2, span_id=2, payload='{"v":1}'),
    ]
    _check(spans, common=True, max_chars=40)
    one = prepare_spans(spans, staging=False, known_start=lambda run: START, max_payload_chars=40)
    assert one is not None and one.data is not None and b"$agentcap.truncated" in one.data


def test_rare_batches_take_the_general_path():
    """Collisions, model calls, unended spans, run roots, superseded spans and invalid events
    leave the batch to the general path."""
    good = _span(seq=1, span_id=1)
    rare = [
        [good, _span(seq=1, span_id=2, key="other")],  # one sequence twice
        [good, _span(seq=2, span_id=2, key="seq:1")],  # one key (so one id) twice
        [good, good],  # the same span twice
        [_span(event_type="model_call")],
        [_span(end=None)],
        [_span(extra={SUPERSEDED: True})],
        [_span(extra={attr.RUN_ROOT: True})],
        [_span(extra={attr.RUN_ATTRIBUTES: '{"a": 1}'})],
        [_span(event_id=str(uuid.uuid4()))],  # not the id of its run, agent and key
        [_span(seq=-1)],
        [_span(seq=True)],
        [_span(seq=2**63)],
        [_span(run="r\x00")],
        [_span(key="k\x00")],
        [_span(key="")],
        [_span(key="\ud800")],
        [_span(event_type="no_such_type")],
        [_span(payload=12)],
        [_span(parents=("not-a-uuid",))],
        [_span(start=0)],
        [_span(span_id=2**70)],
        [_span(events=[Event(attr.SPAN_EVENT_PREFIX + "tool_result", {})])],  # earlier versions
    ]
    assert prepare_spans([good], staging=False, known_start=lambda run: START) is not None
    for spans in rare:
        _check(spans, common=False)


def _mostly(common: Any, *rare: Any) -> st.SearchStrategy[Any]:
    """``common`` four times in five, else one of ``rare``."""
    return st.sampled_from([common] * 4 * len(rare) + list(rare))


_HOSTILE_TEXTS = ("é", "a\x00", "\ud800", "", " ", "x" * 600, "a\x1fb", 5)
_hostile = st.fixed_dictionaries(
    {
        "run": _mostly("r", *_HOSTILE_TEXTS),
        "agent": st.one_of(st.sampled_from(["a", "b", "é"]), _mostly("a", *_HOSTILE_TEXTS)),
        # None: the span's position (no collision)
        "seq": _mostly(None, 0, -1, True, 2**63, "1", 10**30),
        "key": _mostly(None, *_HOSTILE_TEXTS, "k", "ké" * 600),
        "event_type": _mostly("memory_write", "agent_start", "tool_invocation", "bogus", 3),
        "payload": _mostly(
            '{"v":1}',
            None,
            '{"v":"\\u0000"}',
            '{"v":"\\ud800"}',
            '"\\uD800"',
            '{"v":"\\u00e9\\u0000"}',
            '{"v":',
            "[1, 2]",
            '"\ud800"',
            '{"é": "\x00"}',
            "not json",
            12,
        ),
        "parents": st.one_of(
            st.none(),
            st.lists(
                st.one_of(st.uuids().map(str), st.just("x"), st.just(str(uuid.UUID(int=1)))),
                max_size=3,
            ).map(tuple),
        ),
        # None: the span's position (no collision)
        "span_id": _mostly(None, 1, 2**64 - 1, -1, 0),
        "parent": _mostly(0xFFFF, None, 0, 1, 2**64 - 1),
        "trace_id": _mostly(TRACE, 7, 2**600),
        "start": _mostly(NOW_NS, NOW_NS - 10**12, 0, NOW_NS + 10**18),
        "end": _mostly(NOW_NS + 1000, 0, NOW_NS - 10**12, 10**21, 2**63 - 1, -(10**20)),
    }
)
#: Values the one pass takes (what the capture API writes), some of them unusual.
_common = st.fixed_dictionaries(
    {
        "agent": st.sampled_from(["a", "b", "é"]),
        "seq": st.none(),
        "key": st.sampled_from([None, "k", "ké", "tool:x:invocation"]),
        "event_type": st.sampled_from(
            ["memory_write", "memory_read", "agent_start", "tool_invocation", "agent_spawn"]
        ),
        "payload": st.sampled_from([None, '{"v":1}', '{"é":"\\u00e9"}', '{"v":', "[1]"]),
        "parents": st.one_of(st.none(), st.lists(st.uuids().map(str), max_size=2).map(tuple)),
        "span_id": st.none(),
        "trace_id": _mostly(TRACE, 7),
    }
)
_spans = st.lists(st.one_of(_common, _common, _common, _hostile), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(_spans, st.booleans())
def test_any_spans_give_the_general_paths_rows_or_the_general_path(
    drawn: list[dict[str, Any]], staging: bool
) -> None:
    """For spans with any values (hostile ones included) the one pass gives exactly what the
    general path gives, or leaves the batch to it."""
    spans = []
    for index, values in enumerate(drawn):
        if values["seq"] is None:
            values["seq"] = index
        if values["span_id"] is None:
            values["span_id"] = 100 + index
        spans.append(_span(**values))
    _check(spans, staging=staging)


def test_interleaved_agents_are_sorted_as_the_general_path_sorts():
    """Events of several agents handed over in turns give the rows in the general path's order."""
    spans = [
        _span(agent=agent, seq=seq, span_id=10 * seq + i, parents=parents)
        for seq in range(1, 4)
        for i, agent in enumerate(("b", "a", "c"))
        for parents in ((event_id_for("r", agent, f"seq:{seq - 1}"),) if seq > 1 else (),)
    ]
    _check(spans, common=True)
    _check(spans, staging=True, common=True)


_VOLATILE = ("recorded_at", "detected_at", "created_at", "updated_at")
_TABLES = ("runs", "agents", "events", "spans", "conflicts", "record_conflicts")


def _dump(dsn: str) -> dict[str, list[str]]:
    """Every row of the log's tables as JSON text, sorted, without the times of storage."""
    drop = " - ".join(f"'{column}'" for column in _VOLATILE)
    with psycopg.connect(dsn) as conn:
        return {
            table: sorted(
                row[0]
                for row in conn.execute(
                    f"SELECT (to_jsonb(t) - {drop})::text FROM agentcap.{table} t"
                )
            )
            for table in _TABLES
        }


def _hostile_spans(run_id: str) -> list[ReadableSpan]:
    """Hand-built spans of ``run_id``: valid ones, and ones whose values a capture never sets."""
    base = NOW_NS - 10**9
    spans = [
        _span(run=run_id, seq=seq, span_id=500 + seq, start=base + seq, payload=payload)
        for seq, payload in enumerate(
            ['{"v":1}', '{"v":"\\u0000"}', '{"v":', '"\ud800"', '{"é":"\x00"}', None, "[1]"]
        )
    ]
    spans += [
        _span(run=run_id, seq=100, span_id=600, key="\ud800"),
        _span(run=run_id, seq=101, span_id=601, key=""),
        _span(run=run_id, seq=-1, span_id=602),
        _span(run=run_id, seq=102, span_id=603, event_type="bogus"),
        _span(run=run_id, seq=103, span_id=604, event_id=str(uuid.uuid4())),
        _span(run=run_id, seq=104, span_id=605, parents=("not-a-uuid",)),
        _span(run=run_id, agent="a\x00", seq=105, span_id=606),
        _span(run=run_id, seq=106, span_id=607, payload="x" * 300_000),
        _span(run=run_id, seq=107, span_id=608, event_type="model_call", payload=None),
    ]
    return spans


@pytest.mark.storage
def test_stored_rows_are_the_same_with_and_without_the_one_pass(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with every event type, re-sent and conflicting events and hostile values, stored by
    the exporter in batches on both paths (direct and staged), leaves the same rows in every
    table with the one pass as without it."""
    from otel_agentcap.exporters.postgres import PostgresSpanExporter
    from otel_agentcap.exporters.postgres import exporter as exporter_module

    run_id = f"one-pass-{uuid.uuid4().hex[:8]}"
    spans = _captured(run_id)
    stamped = [s for s in spans if attr.EVENT_ID in attributes_of(s)]
    # The same spans with other payloads: conflicts with the stored events.
    changed = [
        _span(
            run=str(attributes_of(s)[attr.RUN_ID]),
            agent=str(attributes_of(s)[attr.AGENT_ID]),
            seq=attributes_of(s)[attr.EVENT_SEQ],
            key=attributes_of(s).get(attr.EVENT_IDEMPOTENCY_KEY),
            event_type=str(attributes_of(s)[attr.EVENT_TYPE]),
            payload='{"changed": true}',
            span_id=s.context.span_id,  # type: ignore[union-attr]
            trace_id=s.context.trace_id,  # type: ignore[union-attr]
        )
        for s in stamped[:3]
    ]
    hostile = _hostile_spans(run_id)
    other = _captured(f"{run_id}-b")
    batches = [
        spans,
        # A run's spans before its root span (whose start the exporter does not know yet).
        [s for s in other if attr.EVENT_ID in attributes_of(s)],
        other,
        stamped,
        stamped[2:] + changed,
        [hostile[i] for i in (0, 1, 3, 5, 6)],
        # Payload text that is not JSON among common spans: taken by the one pass, refused by
        # the server, stored after the general path's second mapping (payloads parsed).
        [hostile[i] for i in (2, 4)],
        hostile,
        stamped[::-1],
    ]
    dumps = []
    taken: list[object] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        one = prepare_spans(*args, **kwargs)
        if one is not None:
            taken.append(one)
        return one

    for one_pass_on in (True, False):
        monkeypatch.setattr(
            exporter_module, "prepare_spans", counted if one_pass_on else lambda *a, **k: None
        )
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "TRUNCATE agentcap.events, agentcap.agents, agentcap.runs, agentcap.conflicts,"
                " agentcap.spans, agentcap.record_conflicts RESTART IDENTITY"
            )
        exporter = PostgresSpanExporter(pg_dsn)
        try:
            for direct in (True, False):
                for batch in batches:
                    parts = exporter.prepare_parts(batch, direct=direct)
                    outcomes = [f.result() for f in exporter.submit(parts, direct=direct)]
                    exporter.settle(parts, outcomes)
            stats = exporter.stats()
        finally:
            exporter.shutdown()
        dumps.append((_dump(pg_dsn), stats))
    (with_one_pass, stats_with), (without, stats_without) = dumps
    assert with_one_pass["events"] and with_one_pass["conflicts"] and with_one_pass["spans"]
    assert len(taken) >= 6  # the common batches, on both paths
    assert with_one_pass == without
    assert stats_with == stats_without


def test_a_span_ended_at_zero_gets_the_general_paths_envelope():
    """A span whose end time is 0 is stored with the envelope the general path gives it."""
    _check([_span(end=0)])
    _check([_span(seq=1, span_id=1), _span(seq=2, span_id=2, end=0)], staging=True)


def test_a_trace_id_longer_than_the_limit_is_rejected_as_the_general_path_rejects_it():
    """A trace id whose text is over 128 characters leaves the batch to the general path,
    which rejects its events."""
    _check([_span(trace_id=2**600)], common=False)
    _check([_span(seq=1, span_id=1), _span(seq=2, span_id=2, trace_id=2**600)], common=False)


def test_an_unexpected_failure_of_the_one_pass_is_counted_and_logged_once(monkeypatch, caplog):
    """An exception of the one pass that the general path does not explain (a bug) leaves the
    spans to the general path, is counted in stats().one_pass_failures and logged once; spans
    the general path rejects are neither counted nor logged as such."""

    def broken(span: Any) -> Any:
        raise RuntimeError("a bug of the one pass")

    monkeypatch.setattr(one_pass_module, "span_shape", broken)
    exporter = PostgresSpanExporter(
        "postgresql://postgres@127.0.0.1:1/none?connect_timeout=1", writers=1
    )
    try:
        with caplog.at_level(logging.ERROR, logger="otel_agentcap.exporters.postgres.exporter"):
            parts = [exporter.prepare_parts([_span(seq=seq, span_id=seq)]) for seq in (1, 2)]
            cut = _span(seq=3, span_id=3, extra={attr.OUTCOME: '{"id": "x", "seq": "4"}'})
            rejected = exporter.prepare_parts([cut])
        stats = exporter.stats()
    finally:
        exporter.shutdown()
    for (part,) in parts:
        assert part.error is None and part.prepared is not None
        assert len(part.prepared.events) == len(part.batch.events) == 1  # the general path
    assert rejected[0].batch.rejected
    assert stats.one_pass_failures == 2
    logged = [r for r in caplog.records if "one pass failed" in r.getMessage()]
    assert len(logged) == 1 and "a bug of the one pass" in logged[0].getMessage()


@pytest.mark.storage
def test_rows_are_built_when_the_prebuilt_copy_data_cannot_be_used(pg_dsn: str) -> None:
    """When the run start the one pass built its COPY data with is not the stored one, the
    writer builds the rows the one pass deferred and stores what the general path stores, on
    the direct and the staging path."""
    from psycopg_pool import ConnectionPool

    from otel_agentcap.exporters.postgres.writer import EventWriter

    suffix = uuid.uuid4().hex[:8]
    batches = {}
    for direct in (True, False):
        spans = [s for s in _captured(f"deferred-{direct}-{suffix}")]
        batches[direct] = [
            s
            for s in spans
            if attr.EVENT_ID in attributes_of(s) and attributes_of(s).get(attr.OUTCOME) is None
        ]
    dumps = []
    for one_pass_on in (True, False):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "TRUNCATE agentcap.events, agentcap.agents, agentcap.runs, agentcap.conflicts,"
                " agentcap.spans, agentcap.record_conflicts RESTART IDENTITY"
            )
        with ConnectionPool(pg_dsn, min_size=1, max_size=2, open=True) as pool:
            writer = EventWriter(pool)
            for direct, spans in batches.items():
                one = prepare_spans(spans, staging=not direct, known_start=lambda run: START)
                assert one is not None and one.data is not None
                if one_pass_on:
                    result = writer.write_prepared(
                        one.prepared,
                        direct=direct,
                        data=one.data,
                        span_data=one.span_data,
                        starts=one.starts,
                    )
                else:
                    result = writer.write_prepared(
                        prepare(_map(spans, raw_payloads=True)), direct=direct
                    )
                assert result.inserted == one.events
        dumps.append(_dump(pg_dsn))
    assert dumps[0]["events"] and dumps[0]["spans"]
    assert dumps[0] == dumps[1]


@settings(max_examples=2000, deadline=None)
@given(
    st.one_of(
        st.integers(min_value=0, max_value=2**63 - 1),
        # Half a microsecond and around it, where the rounding decides.
        st.integers(min_value=946_684_800 * 10**6, max_value=4 * 10**15).map(
            lambda us: us * 1000 + 500
        ),
        st.integers(min_value=946_684_800 * 10**6, max_value=4 * 10**15).flatmap(
            lambda us: st.sampled_from([us * 1000 + 499, us * 1000 + 501, us * 1000 + 999])
        ),
    )
)
def test_span_times_in_microseconds_are_the_general_paths(ns: int) -> None:
    """A span time in nanoseconds gives the microseconds of the datetime the general path
    makes of it (rounded as datetime.fromtimestamp rounds), without the datetime; as a span's
    start and end, the COPY data the general path gives."""
    seconds = ns / 1e9
    try:
        expected = one_pass_module._micros(datetime.fromtimestamp(seconds, tz=UTC))
    except (OverflowError, ValueError, OSError):
        return  # no datetime: the one pass rejects such a time by its range
    assert one_pass_module._seconds_micros(seconds) == expected
    _check([_span(start=ns, end=ns)])


def test_sdk_spans_are_read_through_their_private_attributes_with_this_sdk():
    """With the installed SDK the one pass reads a ReadableSpan's private attributes (what its
    properties return), so its common spans do not take the slower property reads."""
    assert one_pass_module._SDK_SPAN is ReadableSpan
    assert one_pass_module._sdk_span() is ReadableSpan
