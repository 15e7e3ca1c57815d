"""Span records of the durable queue: a span read back maps to exactly the events, agents and
runs of the span that was queued."""

from __future__ import annotations

import contextlib
import json
import marshal
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import Event as SpanEvent
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

import otel_agentcap as ac
from otel_agentcap import attributes as attr
from otel_agentcap.exporters.durable.records import (
    UnknownRecord,
    decode_span,
    encode_span,
    event_count,
)
from otel_agentcap.model import event_id_for
from otel_agentcap.pipeline.mapping import batch_from_spans
from otel_agentcap.testing import capture_events


def _round_trip(span):
    return decode_span(encode_span(span))


def _program() -> None:
    memory = ac.Memory("m")

    @ac.tool
    def double(x: int) -> int:
        return 2 * x

    @ac.tool
    def fail(x: int) -> int:
        raise ValueError(f"bad {x}")

    with ac.run("run-records", owner="me", n=[1, 2]), ac.agent("planner") as planner:
        memory["k"] = {"nested": [1, 2.5, None, "\u00e9\U0001f600"]}
        child = planner.spawn("worker", key="w")

        def work() -> None:
            double.invoke("call-1", memory["k"] and 3)
            with contextlib.suppress(ValueError):
                fail.invoke("call-2", 4)
            with trace.get_tracer("com.anthropic.sdk.python").start_as_current_span(
                "chat m", attributes={attr.GEN_AI_OPERATION_NAME: "chat"}
            ) as span:
                span.set_attributes(
                    {
                        attr.GEN_AI_RESPONSE_ID: "msg_1",
                        "gen_ai.usage.input_tokens": 10,
                        "gen_ai.response.finish_reasons": ("end_turn",),
                    }
                )
                span.set_status(Status(StatusCode.ERROR, "overloaded"))

        child.run(work)


def test_captured_program_maps_the_same_after_the_round_trip():
    """Every span of a captured program (tools, a failed tool, memory, a spawn, run attributes,
    a model call with an error status) maps to the same batch after encode and decode."""
    with capture_events() as captured:
        _program()
    spans = captured.spans
    decoded = [_round_trip(s) for s in spans]
    assert batch_from_spans(decoded) == batch_from_spans(spans)
    assert batch_from_spans(decoded, raw_payloads=True) == batch_from_spans(
        spans, raw_payloads=True
    )


def test_span_events_links_kind_and_status_survive():
    """Legacy agentcap span events, links, the span kind and the status description are kept."""
    attributes = {
        attr.RUN_ID: "r",
        attr.AGENT_ID: "a",
        attr.EVENT_ID: event_id_for("r", "a", "seq:1"),
        attr.EVENT_TYPE: "tool_invocation",
        attr.EVENT_SEQ: 1,
    }
    record = json.dumps(
        {"id": event_id_for("r", "a", "seq:2"), "type": "tool_result", "seq": 2, "payload": 7}
    )
    span = ReadableSpan(
        name="legacy",
        context=SpanContext(trace_id=2**127 + 5, span_id=2**63 + 1, is_remote=False),
        parent=SpanContext(trace_id=2**127 + 5, span_id=9, is_remote=False),
        attributes=attributes,
        events=[
            SpanEvent("agentcap.tool_result", {attr.SPAN_EVENT_RECORD: record}, 5),
            SpanEvent("exception", {"exception.type": "X"}, 6),
        ],
        links=[Link(SpanContext(3, 4, False), {"k": "v"})],
        kind=SpanKind.CLIENT,
        status=Status(StatusCode.ERROR, "boom"),
        start_time=1,
        end_time=9,
        instrumentation_scope=InstrumentationScope("scope", "1.2"),
    )
    back = _round_trip(span)
    assert batch_from_spans([back]) == batch_from_spans([span])
    assert [e.name for e in back.events] == ["agentcap.tool_result"]
    assert back.links[0].context.trace_id == 3 and back.links[0].attributes == {"k": "v"}
    assert back.parent is not None and back.parent.span_id == 9
    assert back.kind is SpanKind.CLIENT
    assert back.status.status_code is StatusCode.ERROR and back.status.description == "boom"
    assert back.instrumentation_scope == ("scope", "1.2")
    assert event_count(span) == 2


attribute_values = st.one_of(
    st.text(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.text(), max_size=3).map(tuple),
    st.lists(st.integers(), max_size=3).map(tuple),
)


@settings(max_examples=200)
@given(
    st.dictionaries(st.text(min_size=1), attribute_values, max_size=8),
    st.dictionaries(st.sampled_from([attr.EVENT_PAYLOAD, attr.OUTCOME]), st.text(), max_size=2),
)
def test_attribute_values_survive(extra, texts):
    """Any attribute value OpenTelemetry allows (text with lone surrogates, 64-bit ints, NaN and
    infinities, tuples) reads back equal (tuples as lists), also in the record's text part."""
    attributes = {attr.EVENT_ID: "x", **extra, **texts}
    span = ReadableSpan(
        name="s",
        context=SpanContext(1, 2, False),
        attributes=attributes,
        start_time=1,
        end_time=2,
    )
    back = _round_trip(span).attributes
    assert set(back) == set(attributes)
    for key, value in attributes.items():
        got = back[key]
        if isinstance(value, tuple):
            assert tuple(got) == value
        elif isinstance(value, float) and math.isnan(value):
            assert math.isnan(got)
        else:
            assert got == value and type(got) is type(value)


def test_a_value_json_cannot_hold_is_kept_as_text():
    """An attribute set around the SDK's checks (bytes, say) does not lose the record."""
    span = ReadableSpan(
        name="s",
        context=SpanContext(1, 2, False),
        attributes={attr.EVENT_ID: "x", "raw": b"\x00\xff", "obj": object()},
        start_time=1,
        end_time=2,
    )
    back = _round_trip(span).attributes
    assert back["raw"] == "\x00\\xff"  # NUL is valid UTF-8; the 0xff byte is escaped
    assert back[attr.EVENT_ID] == "x"


def test_a_later_version_may_append_fields():
    """Fields after the known ones are ignored, so a newer writer's records still read."""
    payload = encode_span(
        ReadableSpan(name="s", context=SpanContext(1, 2, False), attributes={"a": 1}, start_time=1)
    )
    size = int.from_bytes(payload[1:5], "little")
    fields = marshal.loads(payload[5 : 5 + size])
    header = marshal.dumps((*fields, "future", {"x": 1}), 4)
    extended = payload[:1] + len(header).to_bytes(4, "little") + header + payload[5 + size :]
    assert decode_span(extended).attributes == {"a": 1}


def test_a_value_marshal_refuses_falls_back_to_a_json_header():
    """An attribute of a str subclass (marshal writes exact types only) makes a JSON record,
    which reads back the same."""

    class Tag(str):
        pass

    span = ReadableSpan(
        name="s",
        context=SpanContext(1, 2, False),
        attributes={attr.EVENT_ID: "x", "tag": Tag("t"), "seq": (1, 2)},
        start_time=1,
    )
    payload = encode_span(span)
    assert payload[:1] == b"S"
    assert decode_span(payload).attributes == {attr.EVENT_ID: "x", "tag": "t", "seq": [1, 2]}


@pytest.mark.parametrize(
    "payload",
    [
        b"Z{}",
        b"M\x03\x00\x00\x00abc",
        b"M\x01\x00\x00\x00N",
        b"S\x06\x00\x00\x00[1, 2",
        b"S\x02\x00\x00\x00[]",
        b"S\x01",
        b"",
        # A header that names more text than the record holds (cut short).
        b"S\x5c\x00\x00\x00"
        b'["s", 1, 2, null, 1, 2, null, null, 0, null, {}, [], [], 0, 0, [["agentcap.x", 9]]]'
        b"abc",
    ],
)
def test_unknown_or_broken_records_are_refused(payload):
    """A record of an unknown kind, or one that is not a whole span record, raises UnknownRecord."""
    with pytest.raises(UnknownRecord):
        decode_span(payload)
