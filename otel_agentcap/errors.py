"""Exceptions that otel_agentcap raises into user code on purpose (all others are logged)."""

from __future__ import annotations


class AgentCapError(Exception):
    """Base class of otel_agentcap's own errors."""


class AgentCancelled(AgentCapError, TimeoutError):
    """A capture call came from an agent execution that has already timed out or failed, so a
    thread that a timeout could not stop does not go on acting for the agent."""


class AgentTimeoutError(AgentCapError, TimeoutError):
    """An agent execution ran past its timeout; its partial state was rolled back."""


class SpawnConflictError(AgentCapError, ValueError):
    """A spawn reused the identity of an agent that has another parent."""


class RunExistsError(AgentCapError, ValueError):
    """``run(run_id)`` named a run that already exists (in the event log, or opened before in this
    process) without ``resume=True`` or a context carried from the run: merging a new run into a
    stored one silently would mix their events."""
