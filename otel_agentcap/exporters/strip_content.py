"""``ContentStrippingExporter``: send spans to a collector without message content, while the
event log (a separate exporter on the same provider) keeps it.

    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(BatchSpanProcessor(PostgresSpanExporter()))          # with content
    provider.add_span_processor(
        BatchSpanProcessor(ContentStrippingExporter(OTLPSpanExporter()))              # without
    )

Removes the attributes that :func:`otel_agentcap.pipeline.model_calls.is_content_attribute`
names (input and output messages, system instructions, tool definitions, tool call arguments and
results, the ``gen_ai.prompt.*`` / ``gen_ai.completion.*`` attributes of add-on instrumentations)
from spans and span events, and with ``strip_payloads=True`` also agentcap's own payloads
(``agentcap.event.payload`` and the payload inside ``agentcap.outcome`` and span-event records:
tool arguments and results, memory values).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.pipeline.model_calls import is_content_attribute
from otel_agentcap.pipeline.span_copy import copy_with

__all__ = ["ContentStrippingExporter"]

#: Attributes holding a whole event record, payload included.
_RECORDS = (attr.OUTCOME, attr.SPAN_EVENT_RECORD)


def _without_payload(record: str) -> str:
    """An event record (``attributes.OUTCOME``, ``attributes.SPAN_EVENT_RECORD``) with its payload
    removed."""
    parsed = jsonsafe.loads(record)
    if not isinstance(parsed, dict) or "payload" not in parsed:
        return record if "payload" not in record else "{}"
    parsed["payload"] = None
    return json.dumps(parsed, separators=(",", ":"))


class ContentStrippingExporter(SpanExporter):
    """Wraps ``exporter`` and hands it copies of the spans without content attributes."""

    def __init__(self, exporter: SpanExporter, *, strip_payloads: bool = False) -> None:
        self._exporter = exporter
        self._strip_payloads = strip_payloads

    def _keep(self, key: str) -> bool:
        if is_content_attribute(key):
            return False
        return not (self._strip_payloads and key == attr.EVENT_PAYLOAD)

    def _filter(self, attributes: Mapping[str, AttributeValue] | None) -> dict[str, AttributeValue]:
        kept = {k: v for k, v in (attributes or {}).items() if self._keep(k)}
        if self._strip_payloads:
            for key in _RECORDS:
                record = kept.get(key)
                if isinstance(record, str):
                    kept[key] = _without_payload(record)
        return kept

    def _changes(self, attributes: Mapping[str, AttributeValue] | None) -> bool:
        keys = (attributes or {}).keys()
        return not all(self._keep(k) for k in keys) or (
            self._strip_payloads and any(key in keys for key in _RECORDS)
        )

    def _strip(self, span: ReadableSpan) -> ReadableSpan:
        attributes = span.attributes or {}
        events = span.events
        if not self._changes(attributes) and not any(self._changes(e.attributes) for e in events):
            return span
        return copy_with(
            span,
            self._filter(attributes),
            events=[Event(e.name, self._filter(e.attributes), e.timestamp) for e in events],
        )

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._exporter.export([self._strip(span) for span in spans])

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)
