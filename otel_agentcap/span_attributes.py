"""The old import path of :mod:`otel_agentcap.pipeline.span_attributes`: its names, re-exported."""

from otel_agentcap.pipeline.span_attributes import (
    add_attributes,
    attributes_of,
    has_events,
)

__all__ = [
    "add_attributes",
    "attributes_of",
    "has_events",
]
