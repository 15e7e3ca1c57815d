"""otel_agentcap: record multi-agent LLM programs as OpenTelemetry spans with Lamport clocks and
causal parents, and keep them as a deduplicated event log in PostgreSQL.

The capture API below needs only ``opentelemetry-api``; the span processor, the exporters and
``configure`` live in their own modules and import the SDK.
"""

from typing import TYPE_CHECKING

from otel_agentcap.lazy_exports import lazy_exports
from otel_agentcap.version import __version__

if TYPE_CHECKING:
    from otel_agentcap.capture import (
        MISSING,
        Agent,
        AgentExecution,
        AgentScope,
        InvocationInfo,
        Lookup,
        Memory,
        MemoryRecorder,
        RunCarrier,
        Tool,
        agent,
        current_execution,
        current_invocation,
        run,
        run_context,
        spawn,
        tool,
    )
    from otel_agentcap.capture.tool_uses import arun_tool_uses, run_tool_uses
    from otel_agentcap.context import (
        ContextThreadPoolExecutor,
        caused_by,
        current_agent,
        current_run,
        start_thread,
        wrap,
    )
    from otel_agentcap.errors import (
        AgentCancelled,
        AgentCapError,
        AgentTimeoutError,
        MemoryUnavailable,
        RecordedToolError,
        RunExistsError,
        SpawnConflictError,
        ToolOutcomeUnknown,
    )
    from otel_agentcap.model import Event, EventRef, EventType

_EXPORTS = {
    "MISSING": "otel_agentcap.capture",
    "Agent": "otel_agentcap.capture",
    "AgentExecution": "otel_agentcap.capture",
    "AgentScope": "otel_agentcap.capture",
    "InvocationInfo": "otel_agentcap.capture",
    "Lookup": "otel_agentcap.capture",
    "Memory": "otel_agentcap.capture",
    "MemoryRecorder": "otel_agentcap.capture",
    "RunCarrier": "otel_agentcap.capture",
    "Tool": "otel_agentcap.capture",
    "agent": "otel_agentcap.capture",
    "current_execution": "otel_agentcap.capture",
    "current_invocation": "otel_agentcap.capture",
    "run": "otel_agentcap.capture",
    "run_context": "otel_agentcap.capture",
    "spawn": "otel_agentcap.capture",
    "tool": "otel_agentcap.capture",
    "arun_tool_uses": "otel_agentcap.capture.tool_uses",
    "run_tool_uses": "otel_agentcap.capture.tool_uses",
    "ContextThreadPoolExecutor": "otel_agentcap.context",
    "caused_by": "otel_agentcap.context",
    "current_agent": "otel_agentcap.context",
    "current_run": "otel_agentcap.context",
    "start_thread": "otel_agentcap.context",
    "wrap": "otel_agentcap.context",
    "AgentCancelled": "otel_agentcap.errors",
    "AgentCapError": "otel_agentcap.errors",
    "AgentTimeoutError": "otel_agentcap.errors",
    "MemoryUnavailable": "otel_agentcap.errors",
    "RecordedToolError": "otel_agentcap.errors",
    "RunExistsError": "otel_agentcap.errors",
    "SpawnConflictError": "otel_agentcap.errors",
    "ToolOutcomeUnknown": "otel_agentcap.errors",
    "Event": "otel_agentcap.model",
    "EventRef": "otel_agentcap.model",
    "EventType": "otel_agentcap.model",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "MISSING",
    "Agent",
    "AgentCancelled",
    "AgentCapError",
    "AgentExecution",
    "AgentScope",
    "AgentTimeoutError",
    "ContextThreadPoolExecutor",
    "Event",
    "EventRef",
    "EventType",
    "InvocationInfo",
    "Lookup",
    "Memory",
    "MemoryRecorder",
    "MemoryUnavailable",
    "RecordedToolError",
    "RunCarrier",
    "RunExistsError",
    "SpawnConflictError",
    "Tool",
    "ToolOutcomeUnknown",
    "__version__",
    "agent",
    "arun_tool_uses",
    "caused_by",
    "current_agent",
    "current_execution",
    "current_invocation",
    "current_run",
    "run",
    "run_context",
    "run_tool_uses",
    "spawn",
    "start_thread",
    "tool",
    "wrap",
]
