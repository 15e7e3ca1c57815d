"""Run and agent context held in ContextVars.

ContextVars follow ``await``, ``asyncio.gather``, ``create_task`` and ``asyncio.to_thread`` on their
own. Plain threads and ``ThreadPoolExecutor.submit`` start from an empty context, so use
:func:`wrap`, :func:`start_thread` or :class:`ContextThreadPoolExecutor` to carry the current run and
agent (and the current OpenTelemetry span, which is a ContextVar too) into them.

The binding API follows structlog's ``contextvars`` module: ``bind_*`` returns a token, and the
matching ``reset_*`` restores what was there before.
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from otel_agentcap.clock import LamportClock, clocks
from otel_agentcap.errors import AgentCancelled
from otel_agentcap.model import EventRef, event_id_prefix, validate_id

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class RunContext:
    run_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    #: The run was opened before (elsewhere, or earlier here): agents of it may be stored.
    continued: bool = False


@dataclass(slots=True, eq=False)
class AgentContext:
    """One execution of one agent: its identity, its clock and whether it may still act."""

    run_id: str
    agent_id: str
    name: str
    clock: LamportClock
    parent_agent_id: str | None = None
    spawned_at: EventRef | None = None
    deadline: float | None = None  # time.monotonic() value
    cancelled_reason: str | None = None
    execution: Any = None  # the capture layer's object for this execution
    #: The execution that was current where this one was entered: while it may no longer act
    #: (it failed or timed out), neither may this one, which runs on its behalf.
    enclosing: AgentContext | None = None
    #: Set when the execution ended successfully: its deadline no longer stops the executions
    #: it enclosed.
    ended: bool = False
    #: ``model.event_id_prefix(run_id, agent_id)``, computed once for all the execution's events.
    event_id_prefix: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.event_id_prefix = event_id_prefix(self.run_id, self.agent_id)

    def check_active(self) -> None:
        """Raise :class:`AgentCancelled` if this execution may no longer act: it failed or timed
        out, or an execution it runs inside did."""
        if self.cancelled_reason is not None:
            raise AgentCancelled(f"agent {self.agent_id!r} was {self.cancelled_reason}")
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.cancelled_reason = "timed out"
            raise AgentCancelled(f"agent {self.agent_id!r} timed out")
        stopped = self.stopped_enclosing()
        if stopped is not None:
            raise AgentCancelled(
                f"agent {self.agent_id!r} runs inside agent {stopped.agent_id!r}, which "
                f"{stopped.cancelled_reason}"
            )

    def is_cancelled(self) -> bool:
        """Whether this execution may no longer act (:meth:`check_active` would raise)."""
        if self.cancelled_reason is not None:
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.cancelled_reason = "timed out"
            return True
        return self.enclosing is not None and self.stopped_enclosing() is not None

    def stopped_enclosing(self) -> AgentContext | None:
        """The innermost execution this one runs inside that may no longer act, if any."""
        ctx = self.enclosing
        while ctx is not None:
            if ctx.cancelled_reason is not None:
                return ctx
            if not ctx.ended and ctx.deadline is not None and time.monotonic() > ctx.deadline:
                ctx.cancelled_reason = "timed out"
                return ctx
            ctx = ctx.enclosing
        return None


_current_run: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar(
    "agentcap_run", default=None
)
_current_agent: contextvars.ContextVar[AgentContext | None] = contextvars.ContextVar(
    "agentcap_agent", default=None
)
_causal_parents: contextvars.ContextVar[tuple[EventRef, ...]] = contextvars.ContextVar(
    "agentcap_causal_parents", default=()
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


# The getters are the ContextVars' own ``get`` methods: every captured operation calls them, and a
# Python function around each would cost a frame.
current_run: Callable[[], RunContext | None] = _current_run.get
"""The current run, or ``None`` outside any run."""

current_agent: Callable[[], AgentContext | None] = _current_agent.get
"""The current agent execution, or ``None`` outside any agent."""


def bind_run(run: RunContext) -> contextvars.Token[RunContext | None]:
    return _current_run.set(run)


def reset_run(token: contextvars.Token[RunContext | None]) -> None:
    _current_run.reset(token)


def bind_agent(agent: AgentContext | None) -> contextvars.Token[AgentContext | None]:
    return _current_agent.set(agent)


def reset_agent(token: contextvars.Token[AgentContext | None]) -> None:
    _current_agent.reset(token)


def checked_timeout(timeout: float | None) -> float | None:
    """``timeout`` as an agent execution takes it: a positive number of seconds, or None (no
    timeout; so is infinity). Zero, negative and NaN are a ValueError."""
    if timeout is None or timeout == math.inf:
        return None
    if not timeout > 0:  # also NaN, which no comparison accepts
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return timeout


def new_agent_context(
    run_id: str,
    agent_id: str,
    name: str,
    *,
    parent_agent_id: str | None = None,
    spawned_at: EventRef | None = None,
    timeout: float | None = None,
    enclosing: AgentContext | None = None,
) -> AgentContext:
    run_id = validate_id(run_id, "run_id")
    agent_id = validate_id(agent_id, "agent_id")
    timeout = checked_timeout(timeout)
    return AgentContext(
        run_id=run_id,
        agent_id=agent_id,
        name=name,
        clock=clocks.get(run_id, agent_id),
        parent_agent_id=parent_agent_id,
        spawned_at=spawned_at,
        deadline=None if timeout is None else time.monotonic() + timeout,
        enclosing=enclosing,
    )


ambient_causal_parents: Callable[[], tuple[EventRef, ...]] = _causal_parents.get
"""The causal parents bound with :func:`caused_by` around the current code."""


@contextmanager
def caused_by(*parents: EventRef) -> Iterator[None]:
    """Name ``parents`` as causal parents of every event captured inside the block (they add to
    the parents an operation finds itself, such as the write a memory read returns)."""
    for parent in parents:
        if not isinstance(parent, EventRef):
            raise TypeError(f"caused_by takes EventRef values, not {type(parent).__name__}")
    token = _causal_parents.set(_causal_parents.get() + parents)
    try:
        yield
    finally:
        _causal_parents.reset(token)


def wrap(fn: Callable[P, R]) -> Callable[P, R]:
    """Bind ``fn`` to a copy of the current context (run, agent, span) for use in another thread."""
    ctx = contextvars.copy_context()

    def run_in_context(*args: P.args, **kwargs: P.kwargs) -> R:
        return ctx.run(fn, *args, **kwargs)

    return run_in_context


def start_thread(
    fn: Callable[..., Any], *args: Any, name: str | None = None, daemon: bool = True
) -> threading.Thread:
    """Start a thread that runs ``fn(*args)`` in a copy of the current context."""
    thread = threading.Thread(target=wrap(fn), args=args, name=name, daemon=daemon)
    thread.start()
    return thread


class ContextThreadPoolExecutor(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose ``submit`` runs each call in a copy of the submitter's context."""

    def submit(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        ctx = contextvars.copy_context()

        def run_in_context() -> R:
            return ctx.run(fn, *args, **kwargs)

        return super().submit(run_in_context)
