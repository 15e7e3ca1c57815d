"""The old import path of :mod:`otel_agentcap.pipeline.causal_links`: its names, re-exported."""

from otel_agentcap.pipeline.causal_links import (
    MAX_ENTRIES,
    clear,
    forget_run,
    model_call_for_response,
    model_call_for_tool_use,
    new_tool_result_ids,
    record_model_call,
    record_tool_result,
    request_parents,
    tool_result_for,
)

__all__ = [
    "MAX_ENTRIES",
    "clear",
    "forget_run",
    "model_call_for_response",
    "model_call_for_tool_use",
    "new_tool_result_ids",
    "record_model_call",
    "record_tool_result",
    "request_parents",
    "tool_result_for",
]
