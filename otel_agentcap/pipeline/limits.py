"""Span limits for a provider that feeds the event log.

The environment's span limits (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``,
``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``, ...) are meant for what is exported: they bound what a
collector receives. The SDK applies them when an attribute is set, to the one span every processor
sees, so a length limit of a few kilobytes would cut the event log's payloads, and a low count
limit would drop agentcap's stamps (the SDK evicts the oldest attributes first) and with them the
span's events. ``provider_limits`` gives the provider no attribute length limit and room for at
least ``MIN_SPAN_ATTRIBUTES`` attributes; ``LimitedView`` then shows each other processor (a
collector's) the ended span as the environment's limits would have left it, with the SDK's own
rules (``BoundedAttributes``: values cut to the length, the oldest attributes dropped past the
count, and counted as dropped).
"""

from __future__ import annotations

from typing import Final

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor

from otel_agentcap.pipeline.span_copy import copy_with

#: The fewest attributes a span of the provider keeps. The richest spans agentcap records (a model
#: call with content, traced by the anthropic SDK) carry about 32.
MIN_SPAN_ATTRIBUTES: Final = 128


def provider_limits(environment: SpanLimits) -> SpanLimits:
    """``environment``'s limits without a span attribute length limit, and with room for at
    least ``MIN_SPAN_ATTRIBUTES`` attributes (limits of events and links as they are)."""
    count = environment.max_span_attributes
    return SpanLimits(
        max_attributes=environment.max_attributes,
        max_events=_or_unset(environment.max_events),
        max_links=_or_unset(environment.max_links),
        max_span_attributes=SpanLimits.UNSET if count is None else max(count, MIN_SPAN_ATTRIBUTES),
        max_event_attributes=_or_unset(environment.max_event_attributes),
        max_link_attributes=_or_unset(environment.max_link_attributes),
        max_attribute_length=_or_unset(environment.max_attribute_length),
        max_span_attribute_length=SpanLimits.UNSET,
    )


def _or_unset(value: int | None) -> int:
    return SpanLimits.UNSET if value is None else value


def needs_view(environment: SpanLimits) -> bool:
    """Whether ``environment`` limits span attributes more than ``provider_limits`` does."""
    count = environment.max_span_attributes
    return environment.max_span_attribute_length is not None or (
        count is not None and count < MIN_SPAN_ATTRIBUTES
    )


class LimitedView(SpanProcessor):
    """Passes to ``inner`` each ended span with its attributes bounded by ``limits`` (the
    environment's span attribute count and value length), as the SDK would have bounded them.
    A span within them is passed as it is."""

    def __init__(self, inner: SpanProcessor, limits: SpanLimits) -> None:
        self.inner = inner
        self.max_count = limits.max_span_attributes
        self.max_length = limits.max_span_attribute_length

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        self.inner.on_end(self._bounded(span))

    def _bounded(self, span: ReadableSpan) -> ReadableSpan:
        attributes = span.attributes or {}
        length = self.max_length
        if (self.max_count is None or len(attributes) <= self.max_count) and (
            length is None or not any(_longer(value, length) for value in attributes.values())
        ):
            return span
        items = list(attributes.items())
        dropped = 0
        if self.max_count is not None and len(items) > self.max_count:
            # The SDK keeps the newest; cut here, since BoundedAttributes would log each drop.
            dropped = len(items) - self.max_count
            items = items[dropped:]
        bounded = BoundedAttributes(self.max_count, dict(items), True, length)
        return copy_with(span, bounded, dropped_attributes=dropped)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _longer(value: object, length: int) -> bool:
    if isinstance(value, str):
        return len(value) > length
    if isinstance(value, tuple | list):
        return any(isinstance(item, str) and len(item) > length for item in value)
    return False
