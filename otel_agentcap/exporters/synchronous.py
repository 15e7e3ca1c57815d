"""``SynchronousSpanProcessor``: exports each ended span on the thread that ends it, sampled or
not (``configure(batch=False)``). The SDK's ``SimpleSpanProcessor`` skips spans that are not
sampled; the event log records every span (see ``otel_agentcap.pipeline.sampling``)."""

from __future__ import annotations

import logging

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_agentcap.exporters.postgres.database import instrumentation_suppressed

_logger = logging.getLogger(__name__)


class SynchronousSpanProcessor(SimpleSpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None:
            return
        try:
            with instrumentation_suppressed():  # as the SDK's processor does
                self.span_exporter.export((span,))
        except Exception:
            _logger.exception("agentcap: exporting span %r failed", span.name)
