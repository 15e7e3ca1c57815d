"""``AgentCapSpanProcessor``: stamps agent identity, Lamport sequence and causal parents on spans.

Spans created by otel_agentcap's capture API already carry their stamps (set as start attributes,
because the capture code needs the sequence itself, e.g. to chain memory writes). This processor
stamps everything else that starts inside an agent:

* every span gets ``agentcap.run.id``, ``agentcap.agent.id`` and ``gen_ai.agent.id``/``name``;
* spans that are captured operations of their own, such as model-call spans of the anthropic SDK
  or of a GenAI instrumentation (``gen_ai.operation.name`` = ``chat``), also get a sequence, an
  event id and the causal parents bound with :func:`~otel_agentcap.caused_by`, and become
  ``model_call`` events.

Spans started outside any agent pass through untouched. Stamps are written in ``on_start``, where
the span is still mutable, on the thread that starts it; ``on_start`` never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Final

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap.context import current_agent
from otel_agentcap.model import EventType
from otel_agentcap.stamping import stamp

_logger = logging.getLogger(__name__)

#: Returns the event type a foreign span records (or None for "not an event of its own").
SpanClassifier = Callable[[str, Mapping[str, AttributeValue], str | None], str | None]

MODEL_OPERATIONS: Final = frozenset({"chat", "text_completion", "generate_content"})


def classify_genai_span(
    name: str, attributes: Mapping[str, AttributeValue], scope: str | None
) -> str | None:
    """Model calls by the GenAI conventions: ``gen_ai.operation.name`` is a model operation."""
    if attributes.get(attr.GEN_AI_OPERATION_NAME) in MODEL_OPERATIONS:
        return EventType.MODEL_CALL.value
    return None


class AgentCapSpanProcessor(SpanProcessor):
    """Stamps spans started inside an agent. Add it to the TracerProvider before any exporting
    processor, so exporters see the stamps."""

    def __init__(self, classifiers: tuple[SpanClassifier, ...] = (classify_genai_span,)) -> None:
        self._classifiers = classifiers

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        try:
            self._stamp(span)
        except Exception:
            _logger.exception("agentcap: could not stamp span %s", getattr(span, "name", "?"))

    def _stamp(self, span: Span) -> None:
        attributes = span.attributes or {}
        if attr.EVENT_ID in attributes:
            return  # a capture-API span, stamped when it was created
        ctx = current_agent()
        if ctx is None:
            return
        scope = span.instrumentation_scope.name if span.instrumentation_scope else None
        event_type = None
        for classify in self._classifiers:
            event_type = classify(span.name, attributes, scope)
            if event_type is not None:
                break
        if event_type is None:
            span.set_attributes(
                {
                    attr.RUN_ID: ctx.run_id,
                    attr.AGENT_ID: ctx.agent_id,
                    attr.GEN_AI_AGENT_ID: ctx.agent_id,
                    attr.GEN_AI_AGENT_NAME: ctx.name,
                }
            )
            return
        event = stamp(ctx, event_type)
        stamps = event.attributes()
        stamps[attr.GEN_AI_AGENT_ID] = ctx.agent_id
        stamps[attr.GEN_AI_AGENT_NAME] = ctx.name
        span.set_attributes(stamps)

    def on_end(self, span: ReadableSpan) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
