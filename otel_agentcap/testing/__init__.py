"""Helpers for testing code that otel_agentcap captures: collect the captured events, and (in
``otel_agentcap.testing.messages_server``) a local server that speaks the Anthropic Messages API."""

from otel_agentcap.capture.runs import forget_runs
from otel_agentcap.testing._capture import InMemoryEventExporter, capture_events

__all__ = ["InMemoryEventExporter", "capture_events", "forget_runs"]
