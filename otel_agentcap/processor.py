"""The old import path of :mod:`otel_agentcap.pipeline.processor`: its names, re-exported."""

from otel_agentcap.pipeline.processor import (
    MODEL_OPERATIONS,
    AgentCapSpanProcessor,
    SpanClassifier,
    classify_genai_span,
    has_agentcap_processor,
    span_processors_of,
)

__all__ = [
    "MODEL_OPERATIONS",
    "AgentCapSpanProcessor",
    "SpanClassifier",
    "classify_genai_span",
    "has_agentcap_processor",
    "span_processors_of",
]
