"""ContentStrippingExporter hands on copies of spans without content: everything else about a
span, the SDK's dropped counts included, is as it was."""

from __future__ import annotations

from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext

from otel_agentcap.exporters.strip_content import ContentStrippingExporter


def test_a_stripped_copy_keeps_the_span_and_its_dropped_counts() -> None:
    """Content attributes go from the span and its events; name, ids, links, events and the
    counts of what the SDK dropped stay."""
    ended_spans = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_span_attributes=3, max_links=1))
    provider.add_span_processor(SimpleSpanProcessor(ended_spans))
    links = [Link(SpanContext(7, i, is_remote=False)) for i in (1, 2)]
    with provider.get_tracer("t").start_as_current_span("chat m", links=links) as span:
        span.set_attribute("dropped.first", 0)
        span.set_attribute("gen_ai.request.model", "m")
        span.set_attribute("gen_ai.input.messages", "[secret]")
        span.set_attribute("gen_ai.output.messages", "[secret]")
        span.add_event("e", {"gen_ai.tool.call.arguments": "{secret}", "n": 1})
    (ended,) = ended_spans.get_finished_spans()
    forwarded = InMemorySpanExporter()
    ContentStrippingExporter(forwarded).export([ended])
    (copy,) = forwarded.get_finished_spans()
    assert dict(copy.attributes or {}) == {"gen_ai.request.model": "m"}
    assert [dict(e.attributes or {}) for e in copy.events] == [{"n": 1}]
    assert (copy.name, copy.context, copy.links) == (ended.name, ended.context, ended.links)
    assert (
        (copy.dropped_attributes, copy.dropped_links)
        == (1, 1)
        == (
            ended.dropped_attributes,
            ended.dropped_links,
        )
    )
    assert "secret" in str(dict(ended.attributes or {}))  # the original is intact
