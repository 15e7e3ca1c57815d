"""span_attributes: the direct write of attributes (stamps in on_start, closing events) behaves as Span.set_attributes."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import SpanLimits, TracerProvider

from otel_agentcap.pipeline.span_attributes import (
    add_attributes,
    attributes_of,
    set_attributes_in_order,
)

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


def test_spans_built_by_hand_are_read_without_a_warning():
    """A ReadableSpan built with a plain dict (or none) is read as it is; the warning about the
    SDK's private parts is kept for SDK spans whose attributes this module does not know."""
    from opentelemetry.sdk.trace import ReadableSpan

    from otel_agentcap import private_parts

    key = ("opentelemetry-sdk", "ReadableSpan._attributes._dict")
    warned_before = key in private_parts.warned()
    attributes = {"agentcap.run.id": "r"}
    assert attributes_of(ReadableSpan("built", attributes=attributes)) is attributes
    assert attributes_of(ReadableSpan("bare")) == {}
    assert (key in private_parts.warned()) == warned_before


@pytest.mark.parametrize(
    ("limits", "in_order"),
    [
        (SpanLimits(), True),
        (SpanLimits(max_attribute_length=8), False),  # the public API: values cut as it cuts them
        (SpanLimits(max_span_attributes=5), False),
    ],
)
def test_attributes_set_in_order_are_those_of_a_span_started_with_them_all(
    limits: SpanLimits, in_order: bool
):
    """A span started with one attribute then given all in order holds what a span started with
    them all holds, in their order where the direct write applies."""
    tracer = TracerProvider(span_limits=limits).get_tracer("test")
    first = {"agentcap.event.seq": 7}
    ordered = tracer.start_span("op", attributes=first)
    set_attributes_in_order(ordered, STAMPS)
    started = tracer.start_span("op", attributes=STAMPS)
    assert dict(ordered.attributes) == dict(started.attributes)
    if in_order:
        assert list(ordered.attributes) == list(STAMPS)
    ordered.end()
    started.end()


def test_attributes_set_in_order_keep_one_a_processor_added_on_start():
    """An attribute the span got that is not among those set in order is kept."""
    tracer = TracerProvider().get_tracer("test")
    span = tracer.start_span("op", attributes={"agentcap.event.seq": 7})
    span.set_attribute("user.added", "yes")
    set_attributes_in_order(span, STAMPS)
    assert dict(span.attributes) == {"user.added": "yes", **STAMPS}
    span.end()
