"""The old import path of :mod:`otel_agentcap.pipeline.model_calls`: its names, re-exported."""

from otel_agentcap.pipeline.model_calls import (
    CONTENT_ATTRIBUTES,
    CONTENT_PREFIXES,
    OUTPUT_MESSAGES,
    PAYLOAD_SCHEMA,
    SDK_SCOPE,
    STOP_REASON,
    SUPERSEDED,
    TOOL_USE_IDS,
    call_ids,
    is_content_attribute,
    is_sdk_scope,
    model_call_payload,
    status_of,
    usage_of,
)

__all__ = [
    "CONTENT_ATTRIBUTES",
    "CONTENT_PREFIXES",
    "OUTPUT_MESSAGES",
    "PAYLOAD_SCHEMA",
    "SDK_SCOPE",
    "STOP_REASON",
    "SUPERSEDED",
    "TOOL_USE_IDS",
    "call_ids",
    "is_content_attribute",
    "is_sdk_scope",
    "model_call_payload",
    "status_of",
    "usage_of",
]
