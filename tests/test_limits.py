"""Span limits for the event log's provider: the environment's limits bound what the other
processors see, never the spans the log reads."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor

from otel_agentcap.pipeline.limits import (
    MIN_SPAN_ATTRIBUTES,
    LimitedView,
    needs_view,
    provider_limits,
)


class _Seen(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def test_the_provider_has_no_length_limit_and_room_for_the_stamps():
    """The provider drops the environment's span attribute length limit and keeps at least
    MIN_SPAN_ATTRIBUTES attributes; a higher count limit, and the limits of events and links,
    stay as the environment sets them."""
    environment = SpanLimits(max_span_attributes=6, max_attribute_length=100, max_links=7)
    limits = provider_limits(environment)
    assert limits.max_span_attribute_length is None
    assert limits.max_span_attributes == MIN_SPAN_ATTRIBUTES
    assert limits.max_links == 7 and limits.max_attribute_length == 100
    assert provider_limits(SpanLimits(max_span_attributes=500)).max_span_attributes == 500
    assert (
        provider_limits(SpanLimits(max_span_attributes=SpanLimits.UNSET)).max_span_attributes
        is None
    )
    assert needs_view(environment)
    assert not needs_view(SpanLimits(max_span_attributes=MIN_SPAN_ATTRIBUTES))


def test_the_view_bounds_as_the_sdk_would_and_passes_what_fits_as_it_is():
    """Past the count the oldest attributes go (counted as dropped); strings, and the strings of
    sequences, are cut to the length; a span within the limits is the span itself."""
    seen = _Seen()
    view = LimitedView(seen, SpanLimits(max_span_attributes=3, max_span_attribute_length=4))
    within = ReadableSpan("a", attributes={"x": "abcd", "n": 12345})
    view.on_end(within)
    assert seen.spans[-1] is within
    over = ReadableSpan(
        "b", attributes={"old": 1, "older": 2, "s": "abcdefgh", "seq": ("abcdefg", "ab"), "n": 3}
    )
    view.on_end(over)
    bounded = seen.spans[-1]
    assert dict(bounded.attributes) == {"s": "abcd", "seq": ("abcd", "ab"), "n": 3}
    assert bounded.dropped_attributes == 2
    assert bounded.name == "b" and over.attributes["s"] == "abcdefgh"  # the original is intact


def test_the_view_keeps_what_the_sdk_dropped_and_adds_what_it_drops():
    """A bounded span reports the attributes, events and links the SDK had already dropped,
    plus the attributes the view drops (an OTLP exporter sends these counts)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, SpanContext

    provider_seen = InMemorySpanExporter()
    provider = TracerProvider(
        span_limits=SpanLimits(max_span_attributes=4, max_events=1, max_links=1)
    )
    provider.add_span_processor(SimpleSpanProcessor(provider_seen))
    links = [Link(SpanContext(1, i, is_remote=False)) for i in (1, 2, 3)]
    with provider.get_tracer("t").start_as_current_span("s", links=links) as span:
        for i in range(6):
            span.set_attribute(f"a{i}", i)
        span.add_event("first")
        span.add_event("second")
    (ended,) = provider_seen.get_finished_spans()
    assert (ended.dropped_attributes, ended.dropped_events, ended.dropped_links) == (2, 1, 2)
    seen = _Seen()
    LimitedView(seen, SpanLimits(max_span_attributes=3)).on_end(ended)
    bounded = seen.spans[-1]
    assert dict(bounded.attributes) == {"a3": 3, "a4": 4, "a5": 5}
    assert (bounded.dropped_attributes, bounded.dropped_events, bounded.dropped_links) == (3, 1, 2)
