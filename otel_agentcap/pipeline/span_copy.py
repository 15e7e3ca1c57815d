"""``copy_with``: an ended span with other attributes (and events), as the processors and
exporters that reshape spans for a collector hand them on.

A ``ReadableSpan`` built from another's fields reports nothing dropped (its attributes, events
and links are plain collections, not the SDK's bounded ones), so an OTLP exporter would send
``dropped_attributes_count`` 0 for a span that hit the SDK's limits. The copy keeps the counts of
the span it copies, plus whatever the caller dropped on top.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.util.types import AttributeValue

__all__ = ["copy_with"]


class _Copy(ReadableSpan):
    def __init__(
        self,
        span: ReadableSpan,
        attributes: Mapping[str, AttributeValue],
        events: Sequence[Event],
        dropped_attributes: int,
    ) -> None:
        super().__init__(
            name=span.name,
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=attributes,
            events=events,
            links=span.links,
            kind=span.kind,
            status=span.status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )
        self._dropped = (
            span.dropped_attributes + dropped_attributes,
            span.dropped_events,
            span.dropped_links,
        )

    @property
    def dropped_attributes(self) -> int:
        return self._dropped[0]

    @property
    def dropped_events(self) -> int:
        return self._dropped[1]

    @property
    def dropped_links(self) -> int:
        return self._dropped[2]


def copy_with(
    span: ReadableSpan,
    attributes: Mapping[str, AttributeValue],
    *,
    events: Sequence[Event] | None = None,
    dropped_attributes: int = 0,
) -> ReadableSpan:
    """``span`` with ``attributes`` (and ``events``, if given) instead of its own; its dropped
    counts are ``span``'s, with ``dropped_attributes`` more attributes."""
    return _Copy(span, attributes, span.events if events is None else events, dropped_attributes)
