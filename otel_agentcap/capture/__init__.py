"""Capture API: agents, spawns, tools and memory. Needs only ``opentelemetry-api``."""

from otel_agentcap.capture.agents import (
    Agent,
    AgentExecution,
    AgentScope,
    agent,
    current_execution,
    spawn,
)
from otel_agentcap.capture.memory import MISSING, Lookup, Memory, MemoryRecorder
from otel_agentcap.capture.runs import RunCarrier, run, run_context
from otel_agentcap.capture.tools import InvocationInfo, Tool, current_invocation, tool

__all__ = [
    "MISSING",
    "Agent",
    "AgentExecution",
    "AgentScope",
    "InvocationInfo",
    "Lookup",
    "Memory",
    "MemoryRecorder",
    "RunCarrier",
    "Tool",
    "agent",
    "current_execution",
    "current_invocation",
    "run",
    "run_context",
    "spawn",
    "tool",
]
