"""span_attributes: the direct write of attributes (stamps in on_start, closing events) behaves as Span.set_attributes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler
from opentelemetry.trace import SpanKind

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor
from otel_agentcap.pipeline.span_attributes import (
    add_attributes,
    attributes_of,
    start_with_stamps,
)
from otel_agentcap.testing import capture_events

STAMPS: dict[str, Any] = {
    "agentcap.run.id": "run-with-a-long-id",
    "agentcap.agent.id": "agent-with-a-long-id",
    "agentcap.event.seq": 7,
    "agentcap.event.causal_parent_ids": ("parent-event-one", "parent-event-two"),
}


def _started(limits: SpanLimits, existing: int) -> Any:
    tracer = TracerProvider(span_limits=limits).get_tracer("test")
    return tracer.start_span("op", attributes={f"user.{i}": f"value-{i}" for i in range(existing)})


@pytest.mark.parametrize(
    ("limits", "existing"),
    [
        (SpanLimits(), 3),
        (SpanLimits(max_attribute_length=8), 3),  # values are cut to 8 characters
        (SpanLimits(max_span_attributes=5), 3),  # full: the oldest are dropped
        (SpanLimits(max_span_attributes=7), 3),  # exactly full after the write
        (SpanLimits(max_span_attributes=0), 0),  # nothing is kept
    ],
)
def test_start_attributes_are_what_set_attributes_gives(limits: SpanLimits, existing: int):
    direct = _started(limits, existing)
    add_attributes(direct, STAMPS)
    public = _started(limits, existing)
    public.set_attributes(STAMPS)
    assert dict(direct.attributes) == dict(public.attributes)
    assert direct.dropped_attributes == public.dropped_attributes
    direct.end()
    public.end()


@pytest.mark.parametrize(
    ("limits", "direct"),
    [
        (SpanLimits(), True),
        (SpanLimits(max_attribute_length=8), False),
        (SpanLimits(max_span_attributes=4), False),
    ],
)
def test_direct_write_is_used_only_where_it_changes_nothing(limits: SpanLimits, direct: bool):
    span = _started(limits, 1)
    public_calls: list[dict[str, Any]] = []
    span.set_attributes = public_calls.append  # the public API, watched
    add_attributes(span, STAMPS)
    if direct:
        assert public_calls == [] and attributes_of(span)["agentcap.event.seq"] == 7
    else:
        assert public_calls == [STAMPS]
    span.end()


def test_ended_span_is_left_as_the_sdk_leaves_it():
    span = _started(SpanLimits(), 1)
    span.end()
    add_attributes(span, STAMPS)
    assert "agentcap.run.id" not in dict(span.attributes or {})


def test_spans_of_other_kinds_get_the_public_api():
    class OtherSpan:
        def __init__(self) -> None:
            self.attributes: dict[str, Any] = {}

        def set_attributes(self, attributes: dict[str, Any]) -> None:
            self.attributes.update(attributes)

    span = OtherSpan()
    add_attributes(span, STAMPS)
    assert span.attributes == STAMPS


class _Watch(SpanProcessor):
    """Records the attributes each span has when this processor's on_start sees it."""

    def __init__(self, start_inner: Callable[[], None] | None = None) -> None:
        self.at_start: dict[str, dict[str, Any]] = {}
        self._start_inner = start_inner

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        self.at_start[span.name] = dict(span.attributes or {})
        if self._start_inner is not None:
            inner, self._start_inner = self._start_inner, None
            inner()


class _WatchSampler(Sampler):
    def __init__(self) -> None:
        self.seen: dict[str, dict[str, Any]] = {}

    def should_sample(
        self,
        parent_context,
        trace_id,
        name,
        kind=None,
        attributes=None,
        links=None,
        trace_state=None,
    ):  # type: ignore[no-untyped-def]
        self.seen[name] = dict(attributes or {})
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links)

    def get_description(self) -> str:
        return "watch"


AT_CREATION = {attr.EVENT_ID: "event-1", attr.GEN_AI_OPERATION_NAME: "execute_tool"}
HANDED = {attr.EVENT_ID: "event-1", **STAMPS, attr.EVENT_PAYLOAD: '{"x":1}'}


def _start(tracer: Any, name: str = "execute_tool lookup") -> Any:
    return start_with_stamps(tracer, name, None, SpanKind.INTERNAL, AT_CREATION, HANDED, (), None)


def test_handed_stamps_are_on_the_span_when_processors_after_agentcap_see_it():
    sampler = _WatchSampler()
    provider = TracerProvider(sampler=sampler)
    before, after = _Watch(), _Watch()
    provider.add_span_processor(before)
    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(after)
    span = _start(provider.get_tracer("test"))
    # The sampler sees what the span is created with; processors after agentcap's see the stamps
    # too, as they see the stamps of any span started in an agent.
    assert sampler.seen["execute_tool lookup"] == AT_CREATION
    assert before.at_start["execute_tool lookup"] == AT_CREATION
    assert after.at_start["execute_tool lookup"] == {**AT_CREATION, **HANDED}
    assert dict(span.attributes) == {**AT_CREATION, **HANDED}
    span.end()


def test_handed_stamps_reach_the_span_without_an_agentcap_processor():
    provider = TracerProvider()
    watch = _Watch()
    provider.add_span_processor(watch)
    span = _start(provider.get_tracer("test"))
    assert dict(span.attributes) == {**AT_CREATION, **HANDED}
    span.end()
    # Nothing is left over for the next span this thread starts.
    other = provider.get_tracer("test").start_span("other", attributes=AT_CREATION)
    assert dict(other.attributes) == AT_CREATION
    other.end()


def test_a_span_started_inside_on_start_does_not_take_another_spans_stamps():
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    inner: list[Any] = []

    def start_inner() -> None:
        inner.append(tracer.start_span("inner", attributes={attr.EVENT_ID: "event-2"}))

    provider.add_span_processor(_Watch(start_inner))  # runs before agentcap's processor
    provider.add_span_processor(AgentCapSpanProcessor())
    span = _start(tracer)
    assert dict(inner[0].attributes) == {attr.EVENT_ID: "event-2"}
    assert dict(span.attributes) == {**AT_CREATION, **HANDED}
    inner[0].end()
    span.end()


def test_a_tool_span_has_its_stamps_and_payload_in_on_start():
    """The capture API's tool span, on the global provider: a processor added after agentcap's
    sees its run, agent, event and payload when the span starts."""
    with capture_events():
        pass  # installs the global provider with agentcap's processor
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    watch = _Watch()
    provider.add_span_processor(watch)

    @oa.tool
    def lookup(city: str) -> str:
        return city.upper()

    with oa.run(f"handoff-{uuid.uuid4().hex[:8]}") as run, oa.agent("alpha"):
        lookup.invoke("call-1", "oslo")
    seen = watch.at_start["execute_tool lookup"]
    assert seen[attr.RUN_ID] == run.run_id
    assert seen[attr.AGENT_ID] == "alpha"
    assert seen[attr.EVENT_TYPE] == "tool_invocation"
    assert '"arguments":{"city":"oslo"}' in str(seen[attr.EVENT_PAYLOAD])
    assert seen[attr.GEN_AI_TOOL_NAME] == "lookup"
