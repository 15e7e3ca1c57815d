"""Agents, their executions, spawns, timeouts and state rollback."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Final, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind

from otel_agentcap import attributes as attr
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.capture.callables import body_kind, close_unrun, deferred_kind
from otel_agentcap.capture.runs import recorded_runs
from otel_agentcap.clock import clocks
from otel_agentcap.context import (
    AgentContext,
    RunContext,
    bind_agent,
    bind_run,
    checked_timeout,
    current_agent,
    current_run,
    new_agent_context,
    new_id,
    reset_agent,
    reset_run,
    start_thread,
)
from otel_agentcap.errors import AgentCancelled, AgentTimeoutError, SpawnConflictError
from otel_agentcap.forks import renew_locks_after_fork
from otel_agentcap.model import MAX_ID_LENGTH, EventRef, EventType, validate_id
from otel_agentcap.pipeline.stamping import stamp

# Defined in otel_agentcap.protocols, with the package's other interfaces.
from otel_agentcap.protocols import SpawnClaim as SpawnClaim
from otel_agentcap.protocols import SpawnLookup as SpawnLookup
from otel_agentcap.protocols import SpawnRecord as SpawnRecord
from otel_agentcap.protocols import SpawnRegistry as SpawnRegistry
from otel_agentcap.runs import lifetimes

_logger = logging.getLogger("otel_agentcap")

R = TypeVar("R")


class Agent:
    """An agent's identity within a run. Executions of it are scopes (:meth:`scope`) or calls
    (:meth:`run`, :meth:`arun`); its committed state carries from one successful execution to the
    next and is never shared: each execution works on a deep copy."""

    def __init__(
        self,
        run_id: str,
        agent_id: str,
        name: str,
        *,
        parent_agent_id: str | None = None,
        spawned_at: EventRef | None = None,
        spawn_span_context: SpanContext | None = None,
    ) -> None:
        self.run_id = run_id
        self.agent_id = agent_id
        self.name = name
        self.parent_agent_id = parent_agent_id
        self.spawned_at = spawned_at
        self.spawn_span_context = spawn_span_context
        #: ``invoke_agent {agent id}``: the id, not only the name, so that the rows of five
        #: agents named ``researcher`` can be told apart in a trace viewer.
        self.span_name = f"invoke_agent {agent_id}"
        self._state: dict[str, Any] = {}
        self._state_lock = threading.Lock()
        renew_locks_after_fork(self, "_state_lock")

    def __repr__(self) -> str:
        return f"Agent(run_id={self.run_id!r}, agent_id={self.agent_id!r}, name={self.name!r})"

    @property
    def state(self) -> dict[str, Any]:
        """A copy of the state committed by the last successful execution."""
        with self._state_lock:
            return copy.deepcopy(self._state)

    def scope(self, *, timeout: float | None = None) -> AgentScope:
        """A sync or async context manager that runs its block as one execution of this agent."""
        return AgentScope(self, timeout)

    def run(
        self, fn: Callable[..., R], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> R:
        """Run ``fn(*args, **kwargs)`` as one execution of this agent.

        With a ``timeout``, ``fn`` runs in a worker thread (with this context) and the caller gets
        :class:`AgentTimeoutError` when it runs over; the execution is then recorded as failed,
        its state rolled back, and any further capture call from that thread raises
        :class:`~otel_agentcap.errors.AgentCancelled` (a thread cannot be killed).
        """
        kind = body_kind(fn)
        if kind != "plain":
            raise TypeError(_deferred_message(self.agent_id, kind))
        timeout = checked_timeout(timeout)
        if timeout is None:
            with self.scope():
                return _ran(self.agent_id, fn(*args, **kwargs))
        scope = AgentScope(self, timeout)
        done = threading.Event()
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                with scope:
                    outcome["result"] = _ran(self.agent_id, fn(*args, **kwargs))
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                done.set()

        start_thread(target, name=f"agent-{self.agent_id}")
        if not done.wait(timeout):
            error = AgentTimeoutError(f"agent {self.agent_id!r} timed out after {timeout} s")
            if scope.abandon(error):
                raise error
            # The worker finished the execution first (its end is recorded, its state committed
            # or rolled back): that outcome stands, and the worker is only leaving its scope.
            done.wait()
        if "error" in outcome:
            raise outcome["error"]
        result: R = outcome["result"]
        return result

    async def arun(
        self,
        fn: Callable[..., Awaitable[R]],
        /,
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> R:
        """Await ``fn(*args, **kwargs)`` as one execution of this agent, cancelled after
        ``timeout`` seconds (the caller gets ``TimeoutError``)."""
        async with AgentScope(self, timeout):
            return await fn(*args, **kwargs)

    def _commit(self, state: dict[str, Any]) -> None:
        with self._state_lock:
            self._state = state


def _deferred_message(agent_id: str, kind: str) -> str:
    fix = (
        "use `await agent.arun(...)` instead"
        if kind == "coroutine"
        else "collect its items inside the function instead"
    )
    return (
        f"Agent.run of agent {agent_id!r} got a {kind} function: its body would run after the "
        f"execution ended, outside the agent; {fix}"
    )


def _ran(agent_id: str, result: R) -> R:
    """``result``, unless it is a body that has not run (a sync wrapper around an async function
    returns a coroutine): that is closed, unrun, and refused inside the execution, which records
    the ``TypeError``."""
    kind = deferred_kind(result)
    if kind is None:
        return result
    close_unrun(result)
    raise TypeError(_deferred_message(agent_id, kind))


class AgentExecution:
    """One execution of an agent, as seen inside its scope."""

    def __init__(self, agent: Agent, context: AgentContext, span: Span, start: EventRef) -> None:
        self.agent = agent
        self.context = context
        self.span = span
        self.start_event = start
        self.state: dict[str, Any] = agent.state
        #: Why a successful block's state could not be committed (raised from the scope's exit).
        self.commit_error: TypeError | None = None
        self._finished = False
        self._lock = threading.Lock()
        renew_locks_after_fork(self, "_lock")

    @property
    def run_id(self) -> str:
        return self.agent.run_id

    @property
    def agent_id(self) -> str:
        return self.agent.agent_id

    def spawn(self, name: str, *, key: str | None = None, agent_id: str | None = None) -> Agent:
        """Spawn a child of this agent (see :func:`spawn`)."""
        return _spawn(self.context, name, key=key, agent_id=agent_id)

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self, error: BaseException | None) -> bool:
        """Record the end of the execution, once; commit its state on success, roll it back on
        failure. Returns False if it had already finished."""
        if self._finished:
            return False
        ctx = self.context
        committed: dict[str, Any] | None = None
        commit_error: TypeError | None = None
        interrupted: BaseException | None = None
        if error is None:
            try:
                # A copy, so later changes to execution.state do not reach the committed state,
                # and a state that the next execution could not copy fails here, where it is set.
                # Made before the outcome is decided: it runs the user's code (a __deepcopy__),
                # and a timeout that comes meanwhile (Agent.run) must still win.
                copied = copy.deepcopy(self.state)
                if not isinstance(copied, dict):
                    raise TypeError(f"it is a {type(copied).__name__}, not a dict")
                committed = copied
            except Exception as exc:
                error = commit_error = TypeError(
                    f"the state of agent {self.agent_id!r} cannot be committed: it must be a dict "
                    f"of values that copy.deepcopy can copy ({type(exc).__name__}: {exc})"
                )
            except BaseException as exc:
                # Interrupted (Ctrl-C) while copying: nothing is committed, the execution is
                # recorded as failed by the interrupt, which then goes on.
                error = interrupted = exc
        with self._lock:
            if self._finished:
                if interrupted is not None:
                    raise interrupted
                return False
            self._finished = True
        # Ended, it stops the executions entered inside it by its own outcome only (a failure),
        # never by its enclosing one's: the link goes, so that a chain of executions each entered
        # in a context carried from the one before does not keep them all alive.
        ctx.enclosing = None
        if committed is not None:
            ctx.ended = True
            end = stamp(ctx, EventType.AGENT_END, key=None)
            self.agent._commit(committed)  # noqa: SLF001 (its own agent, same module)
            tel.finish_span(self.span, end, {"state_committed": True})
            return True
        if commit_error is not None:
            self.commit_error = commit_error
        assert error is not None
        ctx.cancelled_reason = "timed out" if isinstance(error, TimeoutError) else "failed"
        rolled_back = _state_keys(self.state)
        self.state = {}
        payload = tel.error_payload(
            error,
            timed_out=isinstance(error, TimeoutError),
            state_rolled_back=True,
            discarded_state_keys=rolled_back,
        )
        tel.finish_span(self.span, stamp(ctx, EventType.AGENT_ERROR), payload, error)
        if interrupted is not None:
            raise interrupted
        return True


def _live(ctx: AgentContext | None) -> AgentContext | None:
    """``ctx`` unless its execution ended successfully (it can no longer stop anything)."""
    return None if ctx is None or ctx.ended else ctx


def _state_keys(state: Any) -> list[str]:
    """The keys of an execution's state, for the record of a rollback; never raises."""
    if not isinstance(state, dict):
        return [f"<state is a {type(state).__name__}, not a dict>"]
    keys: list[str] = []
    for key in state:
        try:
            keys.append(str(key))
        except Exception:
            keys.append(f"<{type(key).__name__}>")
    return sorted(keys)


class AgentScope:
    """Context manager (sync and async) for one execution of an agent."""

    def __init__(self, agent: Agent, timeout: float | None) -> None:
        self.agent = agent
        self.timeout = checked_timeout(timeout)
        self.execution: AgentExecution | None = None
        self._tokens: tuple[Any, ...] = ()
        self._async_timeout: asyncio.Timeout | None = None
        self._started_at = 0.0
        self._lock = threading.Lock()
        renew_locks_after_fork(self, "_lock")
        self._entered = False

    def _create_execution(self) -> AgentExecution:
        """Record agent_start and open the span; binds nothing (may run on any thread)."""
        agent = self.agent
        ctx = new_agent_context(
            agent.run_id,
            agent.agent_id,
            agent.name,
            parent_agent_id=agent.parent_agent_id,
            spawned_at=agent.spawned_at,
            timeout=self.timeout,
            enclosing=_live(current_agent()),
        )
        parents = (agent.spawned_at,) if agent.spawned_at is not None else ()
        start = stamp(ctx, EventType.AGENT_START, parents=parents)
        extra: dict[str, Any] = {
            attr.GEN_AI_OPERATION_NAME: attr.OP_INVOKE_AGENT,
        }
        if agent.parent_agent_id is not None:
            extra[attr.PARENT_AGENT_ID] = agent.parent_agent_id
        if agent.spawned_at is not None:
            extra[attr.SPAWNED_AT_EVENT_ID] = agent.spawned_at.event_id
        run = current_run()
        if run is not None and run.run_id == agent.run_id and run.attributes:
            extra[attr.RUN_ATTRIBUTES] = tel.run_attributes_json(run.attributes)
        # A spawned child runs under the create_agent span that spawned it, wherever it runs
        # (also in another process, from the stored spawn); a top-level agent under the current
        # span inside its run, and under the run's span as this process knows it when entered
        # where its run is not current (a plain thread, a worker started before the run), so
        # that it stays in the run's trace.
        under = agent.spawn_span_context
        if under is None or not under.is_valid:
            under = None
            if run is None or run.run_id != agent.run_id:
                known = recorded_runs.known(agent.run_id)
                if known is not None and known.span is not None and known.span.is_valid:
                    under = known.span
        parent = trace.set_span_in_context(NonRecordingSpan(under)) if under is not None else None
        payload = {"name": agent.name, "timeout": self.timeout}
        span = tel.start_event_span(
            agent.span_name, start, payload, extra, SpanKind.INTERNAL, parent
        )
        execution = AgentExecution(agent, ctx, span, start.ref_on(span.get_span_context()))
        ctx.execution = execution
        return execution

    def _enter(self) -> AgentExecution:
        enclosing = current_agent()
        if enclosing is not None:
            # A thread or task left running by a failed or timed-out execution cannot go on
            # acting through another agent.
            enclosing.check_active()
        with self._lock:
            if self._entered:
                raise RuntimeError("an AgentScope can be entered once; call agent.scope() again")
            self._entered = True
            execution = self.execution
            if execution is None:
                execution = self._create_execution()
                self.execution = execution
        if execution.finished:
            # Abandoned (timed out) before the worker thread got here: do not run the body.
            raise AgentCancelled(f"agent {self.agent.agent_id!r} timed out before it started")
        agent = self.agent
        lifetimes.enter(agent.run_id)
        ctx = execution.context
        span = execution.span
        run = current_run()
        run_token = (
            bind_run(RunContext(agent.run_id))
            if run is None or run.run_id != agent.run_id
            else None
        )
        otel_token = otel_context.attach(trace.set_span_in_context(span))
        agent_token = bind_agent(ctx)
        self._tokens = (run_token, otel_token, agent_token)
        self._started_at = time.monotonic()
        return execution

    def _exit(self, error: BaseException | None) -> BaseException | None:
        """Finish the execution; returns a timeout error to raise if the block ran over."""
        execution = self.execution
        assert execution is not None
        run_token, otel_token, agent_token = self._tokens
        raise_instead: BaseException | None = None
        if (
            error is None
            and self.timeout is not None
            and time.monotonic() - self._started_at > self.timeout
        ):
            raise_instead = AgentTimeoutError(
                f"agent {self.agent.agent_id!r} ran past its timeout of {self.timeout} s"
            )
            error = raise_instead
        if error is None:
            stopped = execution.context.stopped_enclosing()
            if stopped is not None:
                # It ran on behalf of an execution that failed or timed out meanwhile (a block
                # that swallowed the AgentCancelled of its capture calls): it fails too.
                raise_instead = AgentCancelled(
                    f"agent {self.agent.agent_id!r} ran inside agent {stopped.agent_id!r}, which "
                    f"{stopped.cancelled_reason}"
                )
                error = raise_instead
        try:
            execution.finish(error)
        except Exception:
            _logger.exception("agentcap: could not record the end of %s", self.agent.agent_id)
        finally:
            # Also when the finish was interrupted (Ctrl-C): the agent must not stay bound to
            # the code after the block.
            self._unbind(run_token, otel_token, agent_token)
        if raise_instead is None and execution.commit_error is not None:
            raise_instead = execution.commit_error
        return raise_instead

    def _unbind(self, run_token: Any, otel_token: Any, agent_token: Any) -> None:
        # A scope closed in another context than it was entered in (a generator finalised
        # elsewhere) cannot reset its ContextVars there; that context never saw them set.
        try:
            reset_agent(agent_token)
        except ValueError:
            _logger.debug("agentcap: agent scope closed in another context", exc_info=True)
        try:
            otel_context.detach(otel_token)
        except Exception:
            _logger.debug("agentcap: context detach failed", exc_info=True)
        if run_token is not None:
            try:
                reset_run(run_token)
            except ValueError:
                _logger.debug("agentcap: run scope closed in another context", exc_info=True)
        lifetimes.leave(self.agent.run_id)

    def abandon(self, error: BaseException) -> bool:
        """Finish the execution as failed from outside (a sync timeout); the worker's own exit
        later finds it finished. Returns False if the worker had finished it first."""
        with self._lock:
            if self.execution is None:
                # The worker has not entered yet: record the execution and its failure now.
                self.execution = self._create_execution()
            execution = self.execution
        return execution.finish(error)

    def __enter__(self) -> AgentExecution:
        return self._enter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        raise_instead = self._exit(exc)
        if raise_instead is not None:
            raise raise_instead

    async def __aenter__(self) -> AgentExecution:
        execution = self._enter()
        if self.timeout is not None:
            self._async_timeout = asyncio.timeout(self.timeout)
            await self._async_timeout.__aenter__()
        return execution

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._async_timeout is not None:
            try:
                await self._async_timeout.__aexit__(exc_type, exc, tb)
            except BaseException as timeout_error:
                self._exit(timeout_error)
                raise
        raise_instead = self._exit(exc)
        if raise_instead is not None:
            raise raise_instead


#: The agents of each open run, by agent id; a run's entry goes when the run is released. No lock:
#: entries are added with ``dict.setdefault`` (atomic), so threads of different agents never
#: wait for one another here.
_agents: dict[str, dict[str, Agent]] = {}
#: Spawns being registered, per run and child: a second spawn of the same child in this process
#: waits for the first instead of registering again.
_pending: dict[str, dict[str, _PendingSpawn]] = {}


def _forget_run(run_id: str) -> None:
    _agents.pop(run_id, None)
    _pending.pop(run_id, None)


lifetimes.on_release(_forget_run)


def _run_agents(run_id: str) -> dict[str, Agent]:
    agents = _agents.get(run_id)
    return agents if agents is not None else _agents.setdefault(run_id, {})


class _PendingSpawn:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


_spawn_registry: SpawnRegistry | None = None


def set_spawn_registry(registry: SpawnRegistry | None) -> None:
    """Install the registry that makes spawns known to every process of a run (None: spawns are
    known within this process only)."""
    global _spawn_registry
    _spawn_registry = registry


def spawn_registry() -> SpawnRegistry | None:
    """The installed registry, if any."""
    return _spawn_registry


_registry_failing = False


def _registry_failed(action: str, child_id: str, exc: Exception) -> None:
    """Log a registry that does not answer once per outage of the store, not once per spawn."""
    global _registry_failing
    if not _registry_failing:
        _registry_failing = True
        text = str(exc).strip()
        _logger.warning(
            "agentcap: could not %s the spawn of %s (%s); spawns are recorded in this process "
            "only until the spawn registry answers again",
            action,
            child_id,
            text.splitlines()[0] if text else type(exc).__name__,
        )


def _registry_answered() -> None:
    global _registry_failing
    if _registry_failing:
        _registry_failing = False
        _logger.warning("agentcap: the spawn registry answers again")


class _LookupRegistry:
    """A registry over a lookup of exported spawns: it finds earlier spawns, and otherwise the
    caller's spawn wins (nothing is registered)."""

    def __init__(self, lookup: SpawnLookup) -> None:
        self._lookup = lookup

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        return self._lookup.find(run_id, child_agent_id)

    def register(self, claim: SpawnClaim) -> SpawnRecord:
        found = self._lookup.find(claim.run_id, claim.child_agent_id)
        if found is not None:
            return found
        return SpawnRecord(
            claim.parent_agent_id,
            claim.name,
            EventRef(claim.spawn_event_id, claim.spawn_seq, claim.parent_agent_id),
            won=True,
        )


def set_spawn_lookup(lookup: SpawnLookup | None) -> None:
    """Install a lookup of earlier spawns (see :func:`set_spawn_registry`)."""
    set_spawn_registry(None if lookup is None else _LookupRegistry(lookup))


def _get_or_create_root(run_id: str, agent_id: str, name: str, continued: bool) -> Agent:
    agents = _run_agents(run_id)
    agent = agents.get(agent_id)
    if agent is None:
        stored = _stored_child(run_id, agent_id, name) if continued else None
        agent = agents.setdefault(agent_id, stored or Agent(run_id, agent_id, name))
    return agent


def _stored_child(run_id: str, agent_id: str, name: str) -> Agent | None:
    """The child ``agent_id`` as its stored spawn made it, when a process of a continued run
    enters it by id (taking a child over from another process, say); None when it was never
    spawned."""
    registry = _spawn_registry
    if registry is None:
        return None
    try:
        found = registry.find(run_id, agent_id)
    except Exception as exc:
        _registry_failed("look up", agent_id, exc)
        return None
    _registry_answered()
    return None if found is None else _child_of_record(run_id, agent_id, name, found)


def agent(name: str, *, agent_id: str | None = None, timeout: float | None = None) -> AgentScope:
    """A scope that runs its block as an execution of agent ``agent_id`` (default: ``name``) in
    the current run (a new generated run when none is bound)::

        with otel_agentcap.run("run-1"):
            with otel_agentcap.agent("planner") as planner:
                planner.state["plan"] = [...]
    """
    name = validate_id(name, "name")
    if agent_id is not None:
        agent_id = validate_id(agent_id, "agent_id")
    run = current_run()
    run_id = run.run_id if run is not None else new_id("run")
    continued = run is not None and run.continued
    return AgentScope(_get_or_create_root(run_id, agent_id or name, name, continued), timeout)


def _child_id(parent_agent_id: str, key: str) -> str:
    candidate = f"{parent_agent_id}/{key}"
    if len(candidate.encode("utf-8", "surrogatepass")) <= MAX_ID_LENGTH:
        return candidate
    digest = hashlib.sha256(candidate.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return f"{key[:100]}~{digest}"


def spawn(name: str, *, key: str | None = None, agent_id: str | None = None) -> Agent:
    """Spawn a child of the current agent and record an ``agent_spawn`` event in the parent.

    A child's identity is ``agent_id`` if given, else ``"{parent}/{key}"`` with ``key``
    defaulting to ``name``. Spawning the same identity again (a retry) returns the same child and
    records nothing; so does spawning twice with the same key, which is why workers spawned in a
    loop need distinct keys. There is no "fresh random child": a spawn never creates a second child
    silently. With a spawn registry (``configure()`` installs the PostgreSQL one) this holds for
    every process of the run, from the moment the first spawn returns.
    """
    parent = current_agent()
    if parent is None:
        raise RuntimeError("spawn() must be called inside an agent scope")
    return _spawn(parent, name, key=key, agent_id=agent_id)


def _registered_child(
    parent: AgentContext, child_id: str, agents: dict[str, Agent] | None = None
) -> Agent | None:
    """The child ``child_id`` of ``parent`` if this process spawned it already; raises if another
    agent did."""
    if agents is None:
        agents = _agents.get(parent.run_id, {})
    existing = agents.get(child_id)
    if existing is not None and existing.parent_agent_id != parent.agent_id:
        raise SpawnConflictError(
            f"agent {child_id!r} already exists in run {parent.run_id!r} with parent "
            f"{existing.parent_agent_id!r}, not {parent.agent_id!r}"
        )
    return existing


def _spawn(parent: AgentContext, name: str, *, key: str | None, agent_id: str | None) -> Agent:
    name = validate_id(name, "name")
    if key is not None:
        key = validate_id(key, "key")
    child_id = (
        validate_id(agent_id, "agent_id")
        if agent_id is not None
        else _child_id(parent.agent_id, key if key is not None else name)
    )
    if child_id == parent.agent_id:
        raise SpawnConflictError(f"agent {child_id!r} cannot spawn itself")
    run_id = parent.run_id
    while True:
        agents = _run_agents(run_id)
        existing = _registered_child(parent, child_id, agents)
        if existing is not None:
            return existing
        parent.check_active()
        pending_of_run = _pending.get(run_id)
        if pending_of_run is None:
            pending_of_run = _pending.setdefault(run_id, {})
        mine = _PendingSpawn()
        pending = pending_of_run.setdefault(child_id, mine)
        if pending is not mine:
            # Another thread of this process is registering this child: wait for it (no lock is
            # held meanwhile), then look again.
            pending.done.wait()
            continue
        try:
            existing = _registered_child(parent, child_id, agents)
            if existing is not None:
                return existing
            child = _register_spawn(parent, name, key, child_id)
            return agents.setdefault(child_id, child)
        finally:
            pending_of_run.pop(child_id, None)
            mine.done.set()


def _hex_ids(context: SpanContext) -> tuple[str | None, str | None]:
    if not context.is_valid:
        return None, None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def _register_spawn(parent: AgentContext, name: str, key: str | None, child_id: str) -> Agent:
    """Record the spawn of ``child_id`` (or find the spawn another process registered first) and
    return the child. Runs without any lock: it may ask the database and export a span."""
    registry = _spawn_registry
    if registry is not None:
        # A retry (the child is registered already) starts no span and records nothing.
        try:
            found = registry.find(parent.run_id, child_id)
        except Exception as exc:
            _registry_failed("look up", child_id, exc)
            found = None
        else:
            _registry_answered()
        if found is not None:
            return _registered(parent, name, child_id, found)
    spawn_stamp = stamp(parent, EventType.AGENT_SPAWN, key=f"spawn:{child_id}")
    extra: dict[str, Any] = {
        attr.GEN_AI_OPERATION_NAME: attr.OP_CREATE_AGENT,
        attr.CHILD_AGENT_ID: child_id,
        attr.CHILD_AGENT_NAME: name,
    }
    payload = {"child_agent_id": child_id, "child_name": name, "key": key}
    span_name = f"create_agent {child_id}"
    record: SpawnRecord | None = None
    if registry is None:
        span = tel.start_event_span(span_name, spawn_stamp, payload, extra)
    else:
        # The event goes on the span only if this spawn is the one registered. A span that
        # records nothing (no SDK provider, OTEL_SDK_DISABLED=true) is not registered: its event
        # never reaches the log, and a retry elsewhere would link its child to it.
        span = tel.start_span(span_name, dict(extra), spawn_stamp.links)
        if span.is_recording():
            trace_id, span_id = _hex_ids(span.get_span_context())
            claim = SpawnClaim(
                parent.run_id,
                child_id,
                parent.agent_id,
                name,
                key,
                spawn_stamp.event_id,
                spawn_stamp.seq,
                trace_id,
                span_id,
            )
            try:
                record = registry.register(claim)
            except Exception as exc:
                _registry_failed("register", child_id, exc)
            else:
                if not record.offline:
                    _registry_answered()
            if record is None or (record.offline and record.won):
                # Not in the shared registry yet: its delivery registers it (and leaves the
                # event out if another process registered the child first).
                try:
                    span.set_attribute(attr.SPAWN_UNREGISTERED, True)
                except Exception:
                    _logger.debug("agentcap: could not mark an unregistered spawn", exc_info=True)
        if record is None or record.won:
            tel.stamp_span(span, spawn_stamp, payload)
    if record is None or record.won:
        tel.end_span(span)
        own_span = span.get_span_context()
        spawn_span: SpanContext | None = own_span if own_span.is_valid else None
        spawned_at = spawn_stamp.ref_on(spawn_span)
    else:
        # Another process registered it between the lookup and this registration (two first
        # spawns at once): its spawn counts, this span records no event.
        try:
            span.set_attribute(SPAWN_REGISTERED_EVENT_ID, record.spawned_at.event_id)
        except Exception:
            _logger.debug("agentcap: could not mark a repeated spawn", exc_info=True)
        tel.end_span(span)
        return _registered(parent, name, child_id, record)
    return _child(parent.run_id, parent.agent_id, name, child_id, spawned_at)


def _registered(parent: AgentContext, name: str, child_id: str, record: SpawnRecord) -> Agent:
    """The child of a spawn registered first by another process (or an earlier run of this one):
    the same child, the same spawn event, no second one; the child runs under the stored spawn's
    span, in the run's trace."""
    if record.parent_agent_id != parent.agent_id:
        raise SpawnConflictError(
            f"agent {child_id!r} was spawned in run {parent.run_id!r} by "
            f"{record.parent_agent_id!r}, not {parent.agent_id!r}"
        )
    parent.clock.observe(record.spawned_at.seq)
    return _child_of_record(parent.run_id, child_id, name, record)


def _child_of_record(run_id: str, child_id: str, name: str, record: SpawnRecord) -> Agent:
    """The child a registered spawn made: its parent, name and spawn event, under its span."""
    spawned_at = EventRef(
        record.spawned_at.event_id,
        record.spawned_at.seq,
        record.parent_agent_id,
        record.spawn_span,
    )
    return _child(run_id, record.parent_agent_id, record.name or name, child_id, spawned_at)


def _child(
    run_id: str, parent_agent_id: str, name: str, child_id: str, spawned_at: EventRef
) -> Agent:
    child = Agent(
        run_id,
        child_id,
        name,
        parent_agent_id=parent_agent_id,
        spawned_at=spawned_at,
        spawn_span_context=spawned_at.span,
    )
    # The child's first event must come after the spawn, whatever thread or process runs it.
    clocks.get(run_id, child_id).observe(spawned_at.seq)
    return child


#: On a ``create_agent`` span whose spawn another process registered at the same moment: the id of
#: the registered spawn event (the span itself records no event).
SPAWN_REGISTERED_EVENT_ID: Final = "agentcap.spawn.registered_event_id"


def current_execution() -> AgentExecution | None:
    """The execution whose scope encloses the caller, or None outside any agent."""
    ctx = current_agent()
    execution = ctx.execution if ctx is not None else None
    return execution if isinstance(execution, AgentExecution) else None
