"""mapping: spans to events, agents and runs."""

from __future__ import annotations

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import Event as SpanEvent
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.pipeline.mapping import agents_from_span, batch_from_spans, events_from_span
from otel_agentcap.testing import capture_events


def _stamped(
    event_id: str, seq: int, payload_text: str | None, **more: object
) -> dict[str, object]:
    a: dict[str, object] = {
        attr.RUN_ID: "run-1",
        attr.AGENT_ID: "agent-1",
        attr.GEN_AI_AGENT_NAME: "agent",
        attr.EVENT_ID: event_id,
        attr.EVENT_TYPE: "tool_invocation",
        attr.EVENT_SEQ: seq,
        attr.EVENT_IDEMPOTENCY_KEY: f"seq:{seq}",
        attr.EVENT_CAUSAL_PARENT_IDS: ("p1", "p2"),
    }
    if payload_text is not None:
        a[attr.EVENT_PAYLOAD] = payload_text
    a.update(more)
    return a


def _span(attributes, events=(), name="s", start=1_000_000_000, end=3_000_000_000):
    return ReadableSpan(
        name=name,
        context=SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=False),
        attributes=attributes,
        events=events,
        start_time=start,
        end_time=end,
    )


def test_unstamped_span_maps_to_nothing():
    """A span without an agentcap event id yields no events and no agents."""
    span = _span({"x": 1})
    assert events_from_span(span) == []
    assert agents_from_span(span) == []


def test_stamped_span_maps_fields():
    """A stamped span's attributes become one event with its ids, sequence, parents and payload."""
    [event] = events_from_span(_span(_stamped("e1", 7, '{"a":1}')))
    assert (event.event_id, event.run_id, event.agent_id, event.seq) == (
        "e1",
        "run-1",
        "agent-1",
        7,
    )
    assert event.event_type == "tool_invocation"
    assert event.idempotency_key == "seq:7"
    assert event.causal_parent_ids == ("p1", "p2")
    assert event.payload == {"a": 1}
    assert event.trace_id == f"{0xABC:032x}" and event.span_id == f"{0xDEF:016x}"
    assert event.wall_time.timestamp() == 1.0


def test_unparsable_payload_is_kept():
    """A payload attribute that is not JSON (cut by a length limit) is kept as $agentcap.unparsed."""
    [event] = events_from_span(_span(_stamped("e1", 1, '{"result": "abc')))
    assert event.payload == {"$agentcap.unparsed": '{"result": "abc'}


def _record(event_id, seq, payload_json):
    head = f'{{"id":"{event_id}","type":"tool_result","seq":{seq},"key":"k{seq}","parents":["e1"]'
    return {attr.SPAN_EVENT_RECORD: f'{head},"payload":{payload_json}}}'}


def test_outcome_attribute_becomes_the_closing_event():
    """agentcap.outcome is a further event of the span's agent, timed at the span's end."""
    outcome = _record("e2", 9, '{"result":[1,2]}')[attr.SPAN_EVENT_RECORD]
    span = _span(_stamped("e1", 8, '{"a":1}', **{attr.OUTCOME: outcome}))
    events = events_from_span(span)
    assert [e.event_id for e in events] == ["e1", "e2"]
    closing = events[1]
    assert (closing.run_id, closing.agent_id) == ("run-1", "agent-1")
    assert (closing.seq, closing.event_type, closing.idempotency_key) == (9, "tool_result", "k9")
    assert closing.causal_parent_ids == ("e1",)
    assert closing.payload == {"result": [1, 2]}
    assert closing.wall_time.timestamp() == 3.0
    assert closing.span_id == events[0].span_id


def test_cut_outcome_keeps_the_event():
    """An outcome record cut short by an attribute length limit still yields its event."""
    whole = _record("e2", 9, '{"result": "' + "x" * 100 + '"}')[attr.SPAN_EVENT_RECORD]
    events = events_from_span(_span(_stamped("e1", 8, None, **{attr.OUTCOME: whole[:120]})))
    assert [e.event_id for e in events] == ["e1", "e2"]
    assert "$agentcap.unparsed" in events[1].payload


def test_captured_tool_call_records_its_result_as_outcome():
    """A captured tool call ends its span with the tool_result in agentcap.outcome, and the
    mapping gives back both events of the call."""

    @oa.tool
    def double(x: int) -> int:
        return 2 * x

    with capture_events() as captured, oa.run("r-outcome"), oa.agent("a"):
        double.invoke("c1", 21)
    [span] = [s for s in captured.spans if s.name == "execute_tool double"]
    assert not span.events
    types = [e.event_type for e in events_from_span(span)]
    assert types == ["tool_invocation", "tool_result"]
    assert captured.of_type("tool_result")[0].payload["result"] == 42


def test_span_events_with_prefix_from_earlier_versions_become_events():
    """agentcap.* span events (how earlier versions recorded closing events) become further
    events of the span's agent; others are ignored."""
    extra = SpanEvent("agentcap.tool_result", _record("e2", 9, '"r"'), timestamp=2_000_000_000)
    other = SpanEvent("exception", {"exception.type": "X"}, timestamp=2_500_000_000)
    events = events_from_span(_span(_stamped("e1", 8, None), events=[extra, other]))
    assert [e.event_id for e in events] == ["e1", "e2"]
    assert events[0].payload is None
    assert events[1].payload == "r"
    assert (events[1].run_id, events[1].agent_id) == (events[0].run_id, events[0].agent_id)
    assert (events[1].seq, events[1].idempotency_key, events[1].causal_parent_ids) == (
        9,
        "k9",
        ("e1",),
    )
    assert events[1].wall_time.timestamp() == 2.0


def test_cut_span_event_record_keeps_the_event():
    """A span-event record cut short (attribute length limit) still yields its event, with the
    payload kept as $agentcap.unparsed."""
    whole = _record("e2", 9, '{"result": "' + "x" * 100 + '"}')[attr.SPAN_EVENT_RECORD]
    cut = SpanEvent("agentcap.tool_result", {attr.SPAN_EVENT_RECORD: whole[:120]}, timestamp=1)
    events = events_from_span(_span(_stamped("e1", 8, None), events=[cut]))
    assert [e.event_id for e in events] == ["e1", "e2"]
    assert events[1].seq == 9
    assert "$agentcap.unparsed" in events[1].payload


def test_model_call_payload_from_genai_attributes():
    """A model_call span without payload gets its gen_ai attributes and latency as payload."""
    a = _stamped(
        "m1",
        3,
        None,
        **{
            attr.EVENT_TYPE: "model_call",
            attr.GEN_AI_REQUEST_MODEL: "m",
            attr.GEN_AI_RESPONSE_FINISH_REASONS: ("end_turn",),
            "other": 1,
        },
    )
    [event] = events_from_span(_span(a, name="chat m"))
    p = event.payload
    assert (p["span_name"], p["model"], p["request_model"]) == ("chat m", "m", "m")
    assert p["stop_reason"] == "end_turn"
    assert p["latency_ms"] == 2000.0
    assert "other" not in p


def test_spawn_span_yields_parent_and_child_agents():
    """An agent_spawn span maps to the spawning agent and the child with its spawn event."""
    a = _stamped(
        "s1",
        4,
        None,
        **{
            attr.EVENT_TYPE: "agent_spawn",
            attr.CHILD_AGENT_ID: "kid",
            attr.CHILD_AGENT_NAME: "worker",
        },
    )
    records = agents_from_span(_span(a))
    assert [(r.agent_id, r.parent_agent_id, r.spawned_at_event_id, r.name) for r in records] == [
        ("agent-1", None, None, "agent"),
        ("kid", "agent-1", "s1", "worker"),
    ]


def test_batch_collects_runs_with_earliest_time():
    """batch_from_spans returns every event and one run row at its earliest event."""
    spans = [
        _span(_stamped("e1", 1, None), start=5_000_000_000),
        _span(_stamped("e2", 2, None), start=4_000_000_000),
        _span({"x": 1}),
    ]
    batch = batch_from_spans(spans)
    assert [e.event_id for e in batch.events] == ["e1", "e2"]
    assert len(batch.runs) == 1
    assert batch.runs[0].run_id == "run-1" and batch.runs[0].started_at.timestamp() == 4.0


def test_captured_payload_round_trips_through_mapping():
    """A tool result with non-JSON values comes back from the mapping as the jsonsafe encoding."""

    @oa.tool
    def returns(x: object) -> object:
        return x

    value = {"b": b"\x01", "n": float("nan"), "t": (1, None)}
    with capture_events() as captured, oa.run(f"map-{uuid.uuid4().hex[:8]}"), oa.agent("a"):
        returns(value)
    result = captured.of_type("tool_result")[0].payload["result"]
    assert result == jsonsafe.to_jsonable(value)
    assert result["t"] == [1, None]


SDK = "com.anthropic.sdk.python"
ADDON = "opentelemetry.instrumentation.anthropic"


def _call_span(
    event_id: str,
    seq: int,
    *,
    run: str = "run-1",
    response_id: str | None = None,
    request_id: str | None = None,
    scope: str | None = None,
    error: bool = False,
) -> ReadableSpan:
    """A stamped model-call span recorded by the instrumentation ``scope``."""
    a = _stamped(event_id, seq, None, **{attr.EVENT_TYPE: "model_call", attr.RUN_ID: run})
    if response_id is not None:
        a[attr.GEN_AI_RESPONSE_ID] = response_id
    if request_id is not None:
        a["anthropic.request.id"] = request_id
    if error:
        a[attr.ERROR_TYPE] = "overloaded_error"
    return ReadableSpan(
        name="chat m",
        context=SpanContext(trace_id=0xABC, span_id=seq + 1, is_remote=False),
        attributes=a,
        start_time=1_000_000_000 + seq * 1_000_000,
        end_time=3_000_000_000,
        status=Status(StatusCode.ERROR if error else StatusCode.OK),
        instrumentation_scope=InstrumentationScope(scope) if scope is not None else None,
    )


def test_model_call_recorded_by_two_spans_is_one_event_the_sdks():
    """Two model-call spans with different event ids and one response id map to one event, the
    SDK's even when the add-on's span comes first; the other is kept aside, not lost."""
    spans = [
        _call_span("addon", 1, response_id="msg_1", request_id="req_1", scope=ADDON),
        _call_span("sdk", 2, response_id="msg_1", request_id="req_1", scope=SDK),
        _call_span("other", 3, response_id="msg_2", request_id="req_2", scope=SDK),
    ]
    batch = batch_from_spans(spans)
    assert [e.event_id for e in batch.events] == ["sdk", "other"]
    assert [e.event_id for e in batch.superseded] == ["addon"]
    assert batch.runs[0].started_at == batch.superseded[0].wall_time  # the earliest record


def test_model_call_recorded_twice_without_the_sdk_keeps_the_first():
    """Without an SDK span among them, the first span of a call keeps the event."""
    spans = [
        _call_span("first", 1, response_id="msg_1", scope=ADDON),
        _call_span("second", 2, response_id="msg_1", scope="another.instrumentation"),
    ]
    batch = batch_from_spans(spans, raw_payloads=True)
    assert [e.event_id for e in batch.events] == ["first"]
    assert [e.event_id for e in batch.superseded] == ["second"]


def test_failed_model_call_without_response_id_is_matched_by_request_id():
    """An error response has no response id: two records of it share the request id and map to
    one event; another failed call with its own request id stays an event of its own."""
    spans = [
        _call_span("sdk", 1, request_id="req_err", scope=SDK, error=True),
        _call_span("addon", 2, request_id="req_err", scope=ADDON, error=True),
        _call_span("retry", 3, request_id="req_err2", scope=SDK, error=True),
    ]
    batch = batch_from_spans(spans)
    assert [e.event_id for e in batch.events] == ["sdk", "retry"]
    assert [e.event_id for e in batch.superseded] == ["addon"]
    assert batch.events[0].payload["status"] == "error"


def test_same_response_id_in_two_runs_is_two_events():
    """Call identity is per run: the same response id in two runs is two events."""
    spans = [
        _call_span("a", 1, run="run-a", response_id="msg_1", request_id="req_1", scope=SDK),
        _call_span("b", 2, run="run-b", response_id="msg_1", request_id="req_1", scope=SDK),
    ]
    batch = batch_from_spans(spans)
    assert [e.event_id for e in batch.events] == ["a", "b"]
    assert batch.superseded == ()


def test_capture_events_shows_one_event_per_model_call():
    """Spans of one call that the processor could not join at start (the add-on's span ended
    before the SDK's began) are one model_call event for capture_events, as in the log."""
    with capture_events() as captured, oa.run("run-unjoined"), oa.agent("a"):
        for scope in (ADDON, SDK):
            tracer = trace.get_tracer(scope)
            with tracer.start_as_current_span(
                "chat m", attributes={attr.GEN_AI_OPERATION_NAME: "chat"}
            ) as span:
                span.set_attributes(
                    {attr.GEN_AI_RESPONSE_ID: "msg_1", "anthropic.request.id": "req_1"}
                )
    calls = [s for s in captured.spans if s.name == "chat m"]
    assert len({s.attributes[attr.EVENT_ID] for s in calls}) == 2
    [event] = captured.of_type("model_call")
    assert event.payload["instrumentation"] == SDK


_CALL_IDS = st.tuples(
    st.sampled_from(["run-a", "run-b"]),
    st.sampled_from([None, "msg_1", "msg_2"]),
    st.sampled_from([None, "req_1", "req_2"]),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_CALL_IDS, max_size=12))
def test_model_call_dedup_properties(calls):
    """For any model-call spans: every event is kept or superseded, exactly once; no two kept
    events of a run share a response id or a request id; each superseded event shares one with
    another event of its run and names the kept event of its call."""
    spans = [
        _call_span(
            f"e{i}", i, run=run, response_id=rid, request_id=qid, scope=SDK if sdk else ADDON
        )
        for i, (run, rid, qid, sdk) in enumerate(calls)
    ]
    batch = batch_from_spans(spans)
    ids = [e.event_id for e in batch.events] + [e.event_id for e in batch.superseded]
    assert sorted(ids) == sorted(f"e{i}" for i in range(len(calls)))

    def keys(event):
        p = event.payload
        found = {
            ("r", event.run_id, p.get("response_id")),
            ("q", event.run_id, p.get("request_id")),
        }
        return {k for k in found if k[2] is not None}

    seen: set[tuple[str, str, str]] = set()
    for event in batch.events:
        assert not keys(event) & seen
        seen |= keys(event)
    everything = [*batch.events, *batch.superseded]
    for event in batch.superseded:
        assert any(keys(event) & keys(o) for o in everything if o is not event)

    # Each superseded event names the kept event of its call: one reached from it through
    # shared ids (storage relies on this link, whatever order the records come in).
    def call_of(event):
        reached, frontier = {event.event_id}, keys(event)
        while True:
            more = [o for o in everything if o.event_id not in reached and keys(o) & frontier]
            if not more:
                return reached
            for o in more:
                reached.add(o.event_id)
                frontier |= keys(o)

    kept_ids = {e.event_id for e in batch.events}
    assert len(batch.superseded_by) == len(batch.superseded)
    for event, kept in zip(batch.superseded, batch.superseded_by, strict=True):
        assert kept in kept_ids and kept in call_of(event)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=8))
def test_one_call_recorded_many_times_keeps_the_first_sdk_span(sdk_flags):
    """Spans of one call in any order: one event, the first SDK span's if any, else the first."""
    spans = [
        _call_span(f"e{i}", i, response_id="msg_1", scope=SDK if sdk else ADDON)
        for i, sdk in enumerate(sdk_flags)
    ]
    batch = batch_from_spans(spans)
    winner = sdk_flags.index(True) if True in sdk_flags else 0
    assert [e.event_id for e in batch.events] == [f"e{winner}"]
    assert len(batch.superseded) == len(sdk_flags) - 1


def test_span_envelopes_keep_each_spans_kind_status_and_scope():
    """Envelopes are built from values spans share (one default status object, a scope per
    tracer): spans of one batch that differ in kind, status or scope each keep their own, in
    whatever order they come, also when one status object is shared by several spans."""
    from opentelemetry.trace import SpanKind

    shared_error = Status(StatusCode.ERROR, "tool failed")
    shapes = [
        (SpanKind.INTERNAL, Status(StatusCode.UNSET), "agentcap"),
        (SpanKind.CLIENT, Status(StatusCode.OK), "agentcap"),
        (SpanKind.INTERNAL, shared_error, "agentcap"),
        (SpanKind.INTERNAL, shared_error, "other.scope"),
        (SpanKind.SERVER, Status(StatusCode.ERROR), "other.scope"),
        (SpanKind.INTERNAL, Status(StatusCode.UNSET), "agentcap"),
    ]
    spans = [
        ReadableSpan(
            name=f"s{i}",
            context=SpanContext(trace_id=0xABC, span_id=0x100 + i, is_remote=False),
            attributes=_stamped(str(uuid.uuid4()), i, None),
            kind=kind,
            status=status,
            instrumentation_scope=InstrumentationScope(scope),
            start_time=1_000_000_000,
            end_time=2_000_000_000,
        )
        for i, (kind, status, scope) in enumerate(shapes)
    ]
    for order in (spans, spans[::-1]):
        envelopes = {e.span_id: e for e in batch_from_spans(order).spans}
        for i, (kind, status, scope) in enumerate(shapes):
            envelope = envelopes[f"{0x100 + i:016x}"]
            assert envelope.kind == kind.value
            assert envelope.status_code == status.status_code.value
            assert envelope.status_message == (status.description or None)
            assert envelope.scope_name == scope


def test_a_root_span_with_a_recorded_start_gives_the_run_that_start():
    """A root span that carries the start its log recorded (an export's
    agentcap.run.started_at_unix_nano) gives its run that start, kept by the log as it is; a value
    that is not Unix nanoseconds rejects the span."""
    root = {attr.RUN_ID: "r", attr.RUN_ROOT: True}
    recorded = {**root, attr.RUN_STARTED_AT: 2_000_000_000}
    (run,) = batch_from_spans([_span(recorded)]).runs
    assert run.started_at.timestamp() == 2.0 and run.start_recorded
    (run,) = batch_from_spans([_span(root)]).runs
    assert run.started_at.timestamp() == 1.0 and not run.start_recorded
    for bad in ("2000000000", -1, True, 2.5):
        batch = batch_from_spans([_span({**root, attr.RUN_STARTED_AT: bad})])
        assert batch.runs == () and [i for i, _ in batch.rejected] == [0]
