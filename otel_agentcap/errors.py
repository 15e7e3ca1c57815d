"""Exceptions that otel_agentcap raises into user code on purpose (all others are logged)."""

from __future__ import annotations

from typing import Any


class AgentCapError(Exception):
    """Base class of otel_agentcap's own errors."""


class AgentCancelled(AgentCapError, TimeoutError):
    """A capture call came from an agent execution that has already timed out or failed, so a
    thread that a timeout could not stop does not go on acting for the agent."""


class AgentTimeoutError(AgentCapError, TimeoutError):
    """An agent execution ran past its timeout; its partial state was rolled back."""


class SpawnConflictError(AgentCapError, ValueError):
    """A spawn reused the identity of an agent that has another parent."""


class ToolOutcomeUnknown(AgentCapError):
    """An invocation of an ``at_most_once`` tool was claimed by a process that stopped before it
    recorded an outcome (its lease expired): the body may or may not have run, so it is not run
    again; every retry of the invocation raises this."""

    def __init__(self, invocation_id: str, tool: str, attempt: int = 1) -> None:
        super().__init__(
            f"the outcome of invocation {invocation_id!r} of tool {tool!r} (attempt {attempt}) is "
            "unknown: the process that ran it stopped before recording it, and the tool runs at "
            "most once"
        )
        self.invocation_id = invocation_id
        self.tool = tool
        self.attempt = attempt

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.invocation_id, self.tool, self.attempt))


class RecordedToolError(AgentCapError):
    """A tool error replayed from the ledger in a process that cannot rebuild its original type
    (its module is not imported here, or the type does not read back the same): it carries the
    type's name and the recorded message."""

    def __init__(self, error_type: str, message: str, invocation_id: str, tool: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.invocation_id = invocation_id
        self.tool = tool

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.error_type, self.message, self.invocation_id, self.tool))


class MemoryUnavailable(AgentCapError):
    """A memory backed by a database could not reach it: the read or write did not happen."""


class RunExistsError(AgentCapError, ValueError):
    """``run(run_id)`` named a run that already exists (in the event log, or opened before in this
    process) without ``resume=True`` or a context carried from the run: merging a new run into a
    stored one silently would mix their events."""


class ConfigurationError(AgentCapError, ValueError):
    """A setting the user must fix, found when capture is configured: a DSN that does not parse,
    a failed authentication, a database that does not exist."""
