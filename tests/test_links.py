"""Causal parents as span links: one per parent event, to the span that carries it, with the
parent's event id on the link and still in the attributes; bounded per span; and the GenAI tool
attributes with content capture on."""

from __future__ import annotations

import json
import uuid

import pytest

import otel_agentcap as ac
from otel_agentcap import attributes as attr
from otel_agentcap.capture import _telemetry
from otel_agentcap.testing import capture_events


def _run_id() -> str:
    return f"links-{uuid.uuid4().hex[:12]}"


def _span_of(captured, event_id):
    for span in captured.spans:
        if span.attributes.get(attr.EVENT_ID) == event_id:
            return span
        outcome = span.attributes.get(attr.OUTCOME)
        if outcome and json.loads(outcome)["id"] == event_id:
            return span
    raise AssertionError(f"no span carries {event_id}")


def _links(span):
    return [(link.context.span_id, link.attributes[attr.LINK_EVENT_ID]) for link in span.links]


def test_every_causal_parent_is_a_link_to_its_span():
    """Memory reads and writes, caused_by, spawns and tool results: every event's parents on
    other spans are links from its span, carrying the parent's event id."""
    memory = ac.Memory("m")

    @ac.tool
    def double(x: int) -> int:
        return 2 * x

    with capture_events() as captured, ac.run(_run_id()), ac.agent("writer") as writer:
        first = memory.set("k", 1)
        memory.set("k", 2)  # chains to the first write
        child = writer.spawn("reader")

        def read() -> None:
            assert first is not None
            with ac.caused_by(first):
                double.invoke("c1", memory["k"])

        child.run(read)
    checked = 0
    for event in captured.events:
        span = _span_of(captured, event.event_id)
        for parent in event.causal_parent_ids:
            target = _span_of(captured, parent)
            if target.context.span_id == span.context.span_id:
                continue
            assert (target.context.span_id, parent) in _links(span), (span.name, event)
            assert target.context.trace_id == span.context.trace_id
            checked += 1
    assert checked >= 5


def test_a_tool_result_makes_no_second_link():
    """A tool's span links once to a caused_by parent, though its result names it as well."""
    memory = ac.Memory("m")

    @ac.tool
    def noop() -> None:
        return None

    with capture_events() as captured, ac.run(_run_id()), ac.agent("a"):
        ref = memory.set("k", 1)
        assert ref is not None
        with ac.caused_by(ref):
            noop.invoke("n1")
    (tool,) = [s for s in captured.spans if s.name == "execute_tool noop"]
    assert _links(tool) == [(ref.span.span_id, ref.event_id)]


def test_links_per_span_are_bounded_and_every_parent_stays_in_the_attributes():
    """An event with more causal parents than MAX_CAUSAL_LINKS links to the first ones only; the
    attribute still lists every parent."""
    memory = ac.Memory("m")
    count = attr.MAX_CAUSAL_LINKS + 5
    with capture_events() as captured, ac.run(_run_id()), ac.agent("a"):
        refs = [memory.set(f"k{i}", i) for i in range(count)]
        with ac.caused_by(*[r for r in refs if r is not None]):
            memory.set("sum", count)
    (span,) = [
        s
        for s in captured.spans
        if s.name == "memory_write" and json.loads(s.attributes[attr.EVENT_PAYLOAD])["key"] == "sum"
    ]
    assert len(span.links) == attr.MAX_CAUSAL_LINKS
    assert [eid for _, eid in _links(span)] == [r.event_id for r in refs][: attr.MAX_CAUSAL_LINKS]
    assert len(span.attributes[attr.EVENT_CAUSAL_PARENT_IDS]) == count


@pytest.fixture
def content_on():
    _telemetry.refresh_content_capture(True)
    try:
        yield
    finally:
        _telemetry.refresh_content_capture()


def test_tool_arguments_and_result_in_genai_attributes_with_content_on(content_on):
    """With content capture on, an execute_tool span carries gen_ai.tool.call.arguments and
    gen_ai.tool.call.result as JSON (and the payloads are unchanged)."""

    @ac.tool
    def search(query: str, limit: int = 2) -> list[str]:
        return [query] * limit

    with capture_events() as captured, ac.run(_run_id()), ac.agent("a"):
        search.invoke("s1", "clocks", limit=3)
    (span,) = [s for s in captured.spans if s.name == "execute_tool search"]
    assert json.loads(span.attributes[attr.GEN_AI_TOOL_CALL_ARGUMENTS]) == {
        "query": "clocks",
        "limit": 3,
    }
    assert json.loads(span.attributes[attr.GEN_AI_TOOL_CALL_RESULT]) == ["clocks"] * 3
    invocation, result = (captured.of_type(t)[0] for t in ("tool_invocation", "tool_result"))
    assert invocation.payload["arguments"] == {"query": "clocks", "limit": 3}
    assert result.payload["result"] == ["clocks"] * 3


def test_no_tool_content_attributes_with_content_off():
    """With content capture off (the default), no gen_ai.tool.call.* content attributes."""
    _telemetry.refresh_content_capture(False)

    @ac.tool
    def search(query: str) -> str:
        return query

    with capture_events() as captured, ac.run(_run_id()), ac.agent("a"):
        search.invoke("s1", "clocks")
    (span,) = [s for s in captured.spans if s.name == "execute_tool search"]
    assert attr.GEN_AI_TOOL_CALL_ARGUMENTS not in span.attributes
    assert attr.GEN_AI_TOOL_CALL_RESULT not in span.attributes
