"""Exceptions that otel_agentcap raises into user code on purpose (all others are logged)."""

from __future__ import annotations

from typing import Any, ClassVar


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
    """An invocation of an ``at_most_once`` tool whose attempt ended without recording an
    outcome after its body may have started: its process stopped (its ledger lease expired), or
    the call was cancelled or interrupted. The body may or may not have acted, so it is not run
    again; every retry of the invocation raises this. (A call cancelled while it was still
    claiming the invocation, before its body started, is run by the retry instead.)"""

    #: Why the outcome is unknown, when the ledger reports it: it cannot tell which of these it was.
    IN_LEDGER: ClassVar[str] = (
        "the attempt that claimed it ended without recording an outcome (its process stopped, "
        "or the call was cancelled or interrupted after its body started)"
    )
    #: Why, when this process saw its own attempt end.
    INTERRUPTED: ClassVar[str] = "the call was cancelled or interrupted while its body ran"

    def __init__(
        self, invocation_id: str, tool: str, attempt: int = 1, reason: str | None = None
    ) -> None:
        self.reason = self.IN_LEDGER if reason is None else reason
        super().__init__(
            f"the outcome of invocation {invocation_id!r} of tool {tool!r} (attempt {attempt}) is "
            f"unknown: {self.reason}, so its body may have acted, and the tool runs at most once"
        )
        self.invocation_id = invocation_id
        self.tool = tool
        self.attempt = attempt

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.invocation_id, self.tool, self.attempt, self.reason))


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
