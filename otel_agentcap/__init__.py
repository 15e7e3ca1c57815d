"""otel_agentcap: record multi-agent LLM programs as OpenTelemetry spans with Lamport clocks and
causal parents, and keep them as a deduplicated event log in PostgreSQL.

The capture API below needs only ``opentelemetry-api``; the span processor, the exporters and
``configure`` live in their own modules and import the SDK.
"""

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
from otel_agentcap.version import __version__

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
