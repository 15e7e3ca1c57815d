"""The old import path of :mod:`otel_agentcap.capture.tool_uses`: its names, re-exported."""

from otel_agentcap.capture.tool_uses import (
    ToolSet,
    arun_tool_uses,
    remember_tool_result,
    run_tool_uses,
    sdk_tools_exactly_once,
    set_sdk_tools_exactly_once,
    tool_use_blocks,
    tool_use_scope,
)

__all__ = [
    "ToolSet",
    "arun_tool_uses",
    "remember_tool_result",
    "run_tool_uses",
    "sdk_tools_exactly_once",
    "set_sdk_tools_exactly_once",
    "tool_use_blocks",
    "tool_use_scope",
]
