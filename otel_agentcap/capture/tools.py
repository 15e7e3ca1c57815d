"""Captured tools: ``execute_tool`` spans, invocation and result events, and exactly-once execution
per invocation: in this process per (run, agent, invocation id, tool, input), and across processes
through the tool ledger (:mod:`otel_agentcap.capture.ledger`) when one is installed."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import inspect
import itertools
import json
import logging
import marshal
import random
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, Generic, NamedTuple, ParamSpec, TypeVar, cast, overload

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.capture.callables import body_kind, close_unrun, deferred_kind
from otel_agentcap.capture.ledger import (
    CRASH_POLICIES,
    DEFAULT_CRASH_POLICY,
    JSON_CODEC,
    Codec,
    CrashPolicy,
    LedgerCall,
    LedgerClaim,
    ToolLedger,
    call_digest,
    codec_named,
    encode_error,
    rebuild_error,
    register_codec,
    tool_ledger,
)
from otel_agentcap.capture.values import private_copy, thawed
from otel_agentcap.context import AgentContext, ambient_causal_parents, current_agent
from otel_agentcap.errors import ToolOutcomeUnknown
from otel_agentcap.forks import call_in_child_after_fork
from otel_agentcap.model import (
    EventRef,
    EventType,
    event_id_for,
    event_id_in,
    from_fields,
    validate_id,
)
from otel_agentcap.pipeline.span_attributes import add_attributes
from otel_agentcap.pipeline.stamping import ambient_parents, new_links, stamp
from otel_agentcap.runs import lifetimes

P = ParamSpec("P")
R = TypeVar("R")

_logger = logging.getLogger(__name__)

DEFAULT_MAX_COMPLETED = 100_000
#: The canonical input of a call is compared whole, never cut (the payload is cut separately).
_UNBOUNDED: Final = 1 << 62
#: Polling a ledger claim held by another process: first delay and cap, in seconds (doubling, with
#: jitter). A waiter holds no database connection between polls.
POLL_FIRST: Final = 0.01
POLL_MAX: Final = 0.5

Key = tuple[str, str, str]


class _Invocation:
    """One execution (attempt) of one call; retries of the same call wait on it and share its
    outcome.

    Fields are class-level defaults, set on the instance only when they change: one is created
    for every captured invocation, and ``_Invocation()`` with no ``__init__`` costs next to
    nothing."""

    done: bool = False
    result: Any = None
    #: The result as :func:`~otel_agentcap.capture.values.frozen` bytes, when it is plain data
    #: (then ``result`` is unused): each replay thaws a new copy.
    frozen_result: bytes | None = None
    error: BaseException | None = None
    invocation_event: EventRef | None = None
    result_event: EventRef | None = None
    #: The owner was interrupted (cancelled, KeyboardInterrupt) before an outcome: not an
    #: outcome to replay, so waiters claim the invocation again.
    interrupted: bool = False
    attempt: int = 1
    #: 0 for the first call seen under its invocation id; k > 0 for the k-th call that reused the
    #: id with another tool or input (its events get keys of their own).
    ordinal: int = 0
    #: The call's identity: tool name and canonical input.
    tool: str = ""
    arguments: str = ""
    #: What runs the body: its thread's ident (sync tools) or its asyncio task (async tools).
    runner: object = None
    #: Completion order over the process (see InvocationRegistry); 0 while running.
    generation: int = 0
    #: Where the outcome is recorded across processes, when a ledger protects the call.
    ledger_call: LedgerCall | None = None
    table: _AgentCalls | None = None
    key: Key | None = None


class _AgentCalls:
    """The invocations of one agent of one run. Its lock is held only for dictionary work: each
    agent has its own, so threads serving different agents never contend. A new invocation id is
    added without it (see InvocationRegistry.claim); an id leaves the table only under it."""

    __slots__ = ("by_id", "completed", "finished", "lock", "waiting")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)
        self.waiting = 0
        #: Per invocation id, one entry per identity (tool and input), the latest attempt of each:
        #: the entry itself while there is one (almost always), else a list whose last entry is
        #: the one a caller used last (ran or replayed).
        self.by_id: dict[str, _Invocation | list[_Invocation]] = {}
        #: Finished entries in completion order, for eviction.
        self.completed: deque[_Invocation] = deque()

    def calls(self, invocation_id: str) -> list[_Invocation]:
        """The entries of ``invocation_id`` (lock held)."""
        held = self.by_id.get(invocation_id)
        if held is None:
            return []
        return held if type(held) is list else [held]  # type: ignore[list-item]

    def keep(self, invocation_id: str, calls: list[_Invocation]) -> None:
        """Store the entries of ``invocation_id`` (lock held)."""
        if not calls:
            self.by_id.pop(invocation_id, None)
        else:
            self.by_id[invocation_id] = calls if len(calls) > 1 else calls[0]


class InvocationRegistry:
    """Outcomes of tool invocations in this process, per (run, agent), then invocation id and
    identity (tool and input).

    Scoping by run and agent means one agent's retry never gets another agent's result, and
    matching on tool and input means a reused id with another tool or input is another call.
    A run's outcomes are released when its last scope in this process closes (``runs.lifetimes``).
    Within open runs, the outcomes of the ``max_completed`` most recent completions (over the
    whole process) can be replayed; older ones are forgotten (each agent drops its own on its next
    completion, and a sweep over every agent runs every ``max_completed // 4`` completions, so
    idle agents do not keep them). Running invocations are never forgotten.

    Nothing here is locked process-wide on the path of a call: completions are numbered by an
    atomic counter and each agent's table has its own lock.
    """

    def __init__(self, max_completed: int = DEFAULT_MAX_COMPLETED) -> None:
        self._runs: dict[str, dict[str, _AgentCalls]] = {}
        self._generations = itertools.count(1)
        self._latest = 0
        self._sweep_lock = threading.Lock()
        self._sweep_every = 1
        self.max_completed = max_completed
        call_in_child_after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:  # pragma: no cover - runs in a forked child
        self._sweep_lock = threading.Lock()
        for agents in self._runs.values():
            for table in agents.values():
                table.lock = threading.Lock()
                table.finished = threading.Condition(table.lock)
                table.waiting = 0

    @property
    def max_completed(self) -> int:
        return self._max_completed

    @max_completed.setter
    def max_completed(self, value: int) -> None:
        self._max_completed = value
        self._sweep_every = max(1, value // 4)

    def _expired(self, entry: _Invocation) -> bool:
        return 0 < entry.generation <= self._latest - self._max_completed

    def claim(
        self, key: Key, tool: str = "", arguments: str = "", exactly_once: bool = True
    ) -> tuple[_Invocation, bool]:
        """Return the invocation of this call (``key`` with ``tool`` and ``arguments``) and whether
        the caller owns its execution. With ``exactly_once`` a call that ran, runs or failed is the
        caller's to wait for and replay; without it every call is a new attempt the caller runs."""
        agents = self._runs.get(key[0])
        if agents is None:
            agents = self._runs.setdefault(key[0], {})  # atomic: one dict wins
        table = agents.get(key[1])
        if table is None:
            table = agents.setdefault(key[1], _AgentCalls())
        # The common case, a new invocation id, without the lock: setdefault is atomic, and an id
        # present in the table leaves it only under the lock, so an entry this inserts is never
        # lost to another caller's work on the same id (which then finds it and waits for it).
        entry = _Invocation()
        entry.table = table
        entry.key = key
        entry.tool = tool
        entry.arguments = arguments
        if table.by_id.setdefault(key[2], entry) is entry:
            return entry, True
        with table.lock:
            return self._claim_known(table, key, tool, arguments, exactly_once)

    def _claim_known(
        self,
        table: _AgentCalls,
        key: Key,
        tool: str,
        arguments: str,
        exactly_once: bool,
    ) -> tuple[_Invocation, bool]:
        """:meth:`claim` of an id this agent used before (its table's lock held)."""
        calls = table.calls(key[2])
        absent = not calls  # evicted since claim found it
        match: _Invocation | None = None
        for entry in calls:
            if entry.tool == tool and (
                entry.arguments == arguments or canonical(entry.arguments) == canonical(arguments)
            ):
                match = entry
                break
        if match is not None:
            calls.remove(match)
            if self._expired(match):
                match = None
            elif exactly_once and not match.interrupted:
                calls.append(match)  # used last
                table.keep(key[2], calls)
                return match, False
        entry = _Invocation()
        entry.table = table
        entry.key = key
        entry.tool = tool
        entry.arguments = arguments
        if match is not None:
            # Interrupted, or run again on purpose: the next attempt of the same call.
            entry.attempt = match.attempt + 1
            if match.ordinal:
                entry.ordinal = match.ordinal
        elif calls:
            # Another tool or input under a known id: a call of its own.
            entry.ordinal = max(other.ordinal for other in calls) + 1
        if absent and table.by_id.setdefault(key[2], entry) is not entry:
            # The id was evicted after claim found it, then another caller added it anew without
            # the lock: a plain store would drop that caller's entry (two owners of one call).
            # It is present now and leaves only under this lock, so the next look finds it.
            return self._claim_known(table, key, tool, arguments, exactly_once)
        calls.append(entry)
        table.keep(key[2], calls)
        return entry, True

    def complete(self, key: Key, entry: _Invocation) -> None:
        """Publish the outcome stored on ``entry`` and wake the waiters."""
        generation = next(self._generations)
        if generation > self._latest:
            self._latest = generation
        table = entry.table
        if table is None:
            entry.done = True
            return
        with table.lock:
            entry.generation = generation
            entry.done = True
            completed = table.completed
            completed.append(entry)
            if completed[0].generation <= generation - self._max_completed:
                self._evict(table)
            if table.waiting:
                table.finished.notify_all()
        if generation % self._sweep_every == 0:
            self._sweep()

    def _evict(self, table: _AgentCalls) -> None:
        """Forget ``table``'s outcomes that are no longer among the most recent (lock held)."""
        completed = table.completed
        limit = self._latest - self._max_completed
        by_id = table.by_id
        while completed and completed[0].generation <= limit:
            old = completed.popleft()
            assert old.key is not None
            invocation_id = old.key[2]
            held = by_id.get(invocation_id)
            if held is old:
                del by_id[invocation_id]
            elif type(held) is list and old in held:
                calls = list(held)
                calls.remove(old)
                table.keep(invocation_id, calls)

    def _sweep(self) -> None:
        """Evict in every agent's table (rarely: see the class documentation)."""
        if not self._sweep_lock.acquire(blocking=False):
            return  # another thread sweeps
        try:
            for agents in list(self._runs.values()):
                for table in list(agents.values()):
                    with table.lock:
                        self._evict(table)
        finally:
            self._sweep_lock.release()

    def wait(self, entry: _Invocation, timeout: float | None = None) -> bool:
        """Wait until ``entry`` is done; returns whether it is."""
        table = entry.table
        if table is None:
            return entry.done
        with table.lock:
            if not entry.done:
                table.waiting += 1
                try:
                    table.finished.wait_for(lambda: entry.done, timeout)
                finally:
                    table.waiting -= 1
            return entry.done

    def release(self, key: Key, entry: _Invocation) -> None:
        """Give up an interrupted attempt, so the next call runs the tool again (as the next
        attempt, whose events get keys of their own)."""
        table = entry.table
        if table is None:
            entry.interrupted = entry.done = True
            return
        with table.lock:
            entry.interrupted = True
            entry.done = True
            if table.waiting:
                table.finished.notify_all()

    def lookup(self, key: Key) -> _Invocation | None:
        """The invocation the agent's last call with this id used (ran or replayed), unless it was
        interrupted or forgotten."""
        agents = self._runs.get(key[0])
        table = agents.get(key[1]) if agents is not None else None
        if table is None:
            return None
        with table.lock:
            calls = table.calls(key[2])
            entry = calls[-1] if calls else None
            if entry is None or entry.interrupted or self._expired(entry):
                return None
            return entry

    def forget_run(self, run_id: str) -> None:
        """Release the outcomes of a finished run."""
        self._runs.pop(run_id, None)

    def __len__(self) -> int:
        """Invocations held (running, finished or interrupted), over all runs."""
        total = 0
        for agents in list(self._runs.values()):
            for table in list(agents.values()):
                with table.lock:
                    total += sum(
                        len(held) if type(held) is list else 1
                        for held in list(table.by_id.values())  # claim() adds without the lock
                    )
        return total


invocations = InvocationRegistry()
lifetimes.on_release(invocations.forget_run)


class InvocationInfo(NamedTuple):
    """The invocation a tool body runs as (see :func:`current_invocation`)."""

    run_id: str
    agent_id: str
    #: The id passed to ``invoke`` (None for a plain call).
    invocation_id: str | None
    #: The tool (its name; for a member of an anthropic SDK toolset, the toolset and the name).
    tool: str
    attempt: int
    #: The JSON of the call's input (see :func:`canonical` for the form calls are compared in).
    arguments: str

    @property
    def idempotency_key(self) -> str | None:
        """A key that is the same for every attempt of this call, in every process, and differs
        for any other call (another run, agent, invocation id, tool or input): pass it on to the
        systems the tool changes, so a body run again after a crash does not act twice there.
        None for a plain call."""
        if self.invocation_id is None:
            return None
        digest = call_digest(self.tool, canonical(self.arguments))
        return event_id_for(self.run_id, self.agent_id, f"call:{self.invocation_id}:{digest}")


def canonical(arguments: str) -> str:
    """The canonical form of a call's input given as JSON (as ``jsonsafe.dumps`` wrote it): every
    object's keys sorted, so equal inputs given in another order (keyword arguments, dict keys)
    are one call. Computed only when two texts differ, or for the ledger."""
    try:
        return json.dumps(
            json.loads(arguments), sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )
    except ValueError:
        return arguments


#: The finisher of the invocation whose body runs here (its InvocationInfo is built on demand).
_current_invocation: contextvars.ContextVar[_Finisher | None] = contextvars.ContextVar(
    "agentcap_invocation", default=None
)


def current_invocation() -> InvocationInfo | None:
    """The invocation whose body is running here (a tool called inside an agent), or None."""
    running = _current_invocation.get()
    if running is None:
        return None
    ctx = running.ctx
    key = running.registry_key
    entry = running.entry
    return InvocationInfo(
        ctx.run_id,
        ctx.agent_id,
        key[2] if key is not None else None,
        running.tool.identity,
        entry.attempt if entry is not None else 1,
        running.arguments,
    )


def _called_inside_itself(invocation_id: str) -> RuntimeError:
    return RuntimeError(
        f"invocation {invocation_id!r} is already running in this thread or task: a tool called "
        "inside it with the same invocation id would wait for its own outcome for ever"
    )


#: How many chained causes or contexts a stored error keeps.
_MAX_CHAIN = 8


def _copy_error(error: BaseException, chain_depth: int) -> BaseException:
    """A copy of ``error`` without its traceback, whose chained cause and context (which some
    errors use to carry their detail) are copied likewise down to ``chain_depth`` links. The
    original is returned when it cannot be copied."""
    copied = _same_error(error)
    if copied is None:
        return error
    if chain_depth > 0:
        if error.__cause__ is not None:
            copied.__cause__ = _copy_error(error.__cause__, chain_depth - 1)
        if error.__context__ is not None:
            copied.__context__ = _copy_error(error.__context__, chain_depth - 1)
    copied.__suppress_context__ = error.__suppress_context__
    return copied.with_traceback(None)


def _same_error(error: BaseException) -> BaseException | None:
    """A new exception object equal to ``error``, built without running its ``__init__`` (which
    may have side effects or rewrite its message: ``copy.copy`` calls ``cls(*args)``). Falls back
    to ``copy.copy`` where that loses what builtin errors keep outside ``args`` and ``__dict__``
    (``OSError.filename``, ``UnicodeError`` positions), and returns None if neither works."""
    cls = type(error)
    try:
        copied = cls.__new__(cls, *error.args)
        state = getattr(error, "__dict__", None)
        if state:
            copied.__dict__.update(copy.deepcopy(state))
        copied.args = error.args
        try:
            text = str(error)
        except Exception:
            return copied
        if str(copied) == text:
            return copied
    except Exception:
        pass
    try:
        return copy.copy(error)
    except Exception:
        return None


def _stored_error(error: BaseException) -> BaseException:
    """What the registry keeps of a tool's error: a copy without tracebacks, which would hold
    every frame of the failed call (and its locals) for as long as the outcome is kept."""
    return _copy_error(error, _MAX_CHAIN)


def _replay(entry: _Invocation) -> Any:
    stored = entry.error
    if stored is not None:
        # A fresh copy for every replay (raising an exception object grows its traceback),
        # sharing the stored copy's chain, which has no tracebacks.
        copied = _same_error(stored)
        error = copied if copied is not None else stored
        error.__cause__ = stored.__cause__
        error.__context__ = stored.__context__
        error.__suppress_context__ = stored.__suppress_context__
        raise error.with_traceback(None)
    kept = entry.frozen_result
    if kept is not None:
        return thawed(kept)
    return private_copy(entry.result)


class _Unavailable:
    """Logs a ledger that cannot be reached once per change of state, not once per call."""

    def __init__(self) -> None:
        self.down = False
        self.calls_unprotected = 0

    def failed(self, error: BaseException) -> None:
        self.calls_unprotected += 1
        if not self.down:
            self.down = True
            _logger.warning(
                "agentcap: the tool ledger is unavailable (%s); tool calls run with in-process "
                "exactly-once only until it is back",
                error,
            )

    def ok(self) -> None:
        if self.down:
            self.down = False
            _logger.warning("agentcap: the tool ledger is available again")


ledger_state = _Unavailable()


class _ThreadClaim:
    """One ``ledger.claim`` run in a worker thread for an async caller. A caller cancelled while
    the statement runs has abandoned it: a claim it won is released (by the worker, or, when the
    worker had already finished, by the caller in another thread), so it is not left running and
    renewed by this process while no body runs."""

    __slots__ = ("abandoned", "call", "claim", "ledger", "lock")

    def __init__(self, ledger: ToolLedger, call: LedgerCall) -> None:
        self.ledger = ledger
        self.call = call
        self.lock = threading.Lock()
        self.abandoned = False
        self.claim: LedgerClaim | None = None

    def run(self) -> LedgerClaim:
        claim = self.ledger.claim(self.call)
        with self.lock:
            self.claim = claim
            abandoned = self.abandoned
        if abandoned and claim.state == "claimed":
            self._release_unstarted(claim.attempt)
        return claim

    def _release_unstarted(self, attempt: int) -> None:
        _release_unstarted(self.ledger, self.call, attempt)

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True
            claim = self.claim
        if claim is not None and claim.state == "claimed":
            threading.Thread(
                target=self._release_unstarted,
                args=(claim.attempt,),
                name="agentcap-ledger-release",
                daemon=True,
            ).start()


_GENERATOR_TYPES: Final = (types.GeneratorType, types.AsyncGeneratorType)
#: Results kept frozen when they are plain data (others: immutable ones need no copy, and a tuple
#: of immutable values is kept as it is by private_copy).
_FREEZABLE: Final = frozenset({dict, list})


def _release_unstarted(ledger: ToolLedger, call: LedgerCall, attempt: int) -> None:
    """Give up a claim whose body never started: with a ledger that can record that
    (``release_unstarted``), a retry runs the body even for an ``at_most_once`` tool."""
    unstarted = getattr(ledger, "release_unstarted", None)
    if callable(unstarted):
        unstarted(call, attempt)
    else:
        ledger.release(call, attempt)


def _withdraw_interrupted(ledger: ToolLedger, call: LedgerCall) -> None:
    """A sync caller interrupted (Ctrl-C, ``SystemExit``) while it claimed ``call``: a claim the
    ledger may have committed is withdrawn, with a ledger that can (``withdraw_interrupted``),
    instead of staying running (renewed by this process while no body runs) or, unrenewed, until
    its lease expires."""
    withdraw = getattr(ledger, "withdraw_interrupted", None)
    if not callable(withdraw):
        return
    try:
        withdraw(call)
    except Exception:
        _logger.warning("agentcap: could not withdraw an interrupted claim", exc_info=True)


async def _claim_in_thread(ledger: ToolLedger, call: LedgerCall) -> LedgerClaim:
    pending = _ThreadClaim(ledger, call)
    try:
        return await asyncio.to_thread(pending.run)
    except asyncio.CancelledError:
        pending.abandon()
        raise


def _poll_delays() -> Any:
    delay = POLL_FIRST
    while True:
        yield delay * (0.5 + random.random())
        delay = min(delay * 2, POLL_MAX)


class Tool(Generic[P, R]):
    """A captured tool. Calling it runs the function with its own arguments, untouched; use
    :meth:`invoke` to give the invocation an id that makes retries of the same call return the
    recorded outcome.

    ``crash_policy`` says what a retry does when the process that ran the call died before
    recording its outcome (only a ledger can tell): ``at_least_once`` (the default) runs the body
    again, ``at_most_once`` raises :class:`~otel_agentcap.errors.ToolOutcomeUnknown`. ``codec``
    carries the result to other processes (default: the payload encoding, see
    :class:`~otel_agentcap.capture.ledger.JsonCodec`)."""

    def __init__(
        self,
        fn: Callable[P, R],
        name: str | None = None,
        *,
        crash_policy: CrashPolicy = DEFAULT_CRASH_POLICY,
        codec: Codec | None = None,
    ) -> None:
        self.fn = fn
        if name is None:
            name = getattr(fn, "__name__", None)
            if name is None:
                raise TypeError(
                    f"a {type(fn).__name__} has no __name__ to name the tool by: "
                    "use tool(name=...) or Tool(fn, name=...)"
                )
        self.name = validate_id(name, "tool name")
        #: What tells this tool's calls from another tool's under one invocation id (its name,
        #: or for an SDK toolset member the toolset and the name).
        self.identity = self.name
        if crash_policy not in CRASH_POLICIES:
            raise ValueError(f"crash_policy must be one of {sorted(CRASH_POLICIES)}")
        self.crash_policy: CrashPolicy = crash_policy
        self.codec: Codec = codec if codec is not None else JSON_CODEC
        if codec is not None:
            register_codec(codec)
        self.signature = inspect.signature(fn)
        kind = body_kind(fn)
        if kind in ("generator", "async generator"):
            raise TypeError(
                f"tool {self.name!r} is a {kind} function: its body would run as the caller "
                "iterates, after the call has returned and its outcome was recorded; return the "
                "items (a list) instead"
            )
        #: Whether a call returns an awaitable: an ``async def`` function (or an object whose
        #: ``__call__`` is one), or a function seen returning a coroutine (a sync wrapper around
        #: an async function, which only its first call can reveal).
        self.is_async = kind == "coroutine"
        # Names of leading plain positional parameters: binding a call that passes only those
        # (the common case) is a zip, not a full Signature.bind.
        simple: list[str] = []
        by_keyword: list[str] = []
        for param in self.signature.parameters.values():
            if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                break
            simple.append(param.name)
            if param.kind is param.POSITIONAL_OR_KEYWORD:
                by_keyword.append(param.name)
        self._positional_names = tuple(simple)
        #: Those of them a keyword argument can give: a keyword named like a positional-only
        #: parameter goes to ``**kwargs`` (or is an error), which only a full bind tells.
        self._positional_set = frozenset(by_keyword)
        self._span_name = f"execute_tool {self.name}"
        # Set right after the span starts (gen_ai.operation.name is given at the start: the
        # GenAI conventions name it sampling-relevant).
        self._span_attributes: dict[str, AttributeValue] = {
            attr.GEN_AI_TOOL_NAME: self.name,
            attr.GEN_AI_TOOL_TYPE: "function",
        }
        # Payloads are composed around the encoded arguments or result (tel.tool_payload).
        self._payload_prefix = f'{{"tool":{tel.json_string(self.name)},"invocation_id":'
        #: Whether the ``execute_tool`` span is made current while the body runs (so the body's
        #: own spans are its children). Off for the SDK's tool runners, whose tool span is the
        #: parent of the tool's spans.
        self.current_span = True
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return Tool(
            cast(Callable[P, R], functools.partial(self.fn, instance)),
            self.name,
            crash_policy=self.crash_policy,
            codec=self.codec,
        )

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._call(None, args, kwargs, True)

    def invoke(self, invocation_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the tool as invocation ``invocation_id`` (for example a tool_use block id).

        The first call with an id runs the body; any later or concurrent call with the same id,
        tool and input in the same run and agent returns the recorded result or raises the
        recorded error, without running the body again (across processes too, when a ledger is
        installed). The same id with other input is another call: it runs, and its events record
        the reuse. For an async tool this returns an awaitable.
        """
        return self._call(validate_id(invocation_id, "invocation_id"), args, kwargs, True)

    def run_again(self, invocation_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the tool as invocation ``invocation_id`` and always run its body: a repeated call
        is recorded as the next attempt of the same invocation (events with keys of their own),
        never answered with a recorded outcome. What the anthropic SDK's tool runners use unless
        exactly-once is asked for."""
        return self._call(validate_id(invocation_id, "invocation_id"), args, kwargs, False)

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        names = self._positional_names
        given = len(args)
        if given <= len(names):
            # One or two arguments (most calls) as a display: dict(zip()) costs twice as much.
            if given == 1:
                fast = {names[0]: args[0]}
            elif given == 2:
                fast = {names[0]: args[0], names[1]: args[1]}
            else:
                # zip's default (not strict): strict=False costs a keyword argument on every call.
                fast = dict(zip(names, args))  # noqa: B905
            if not kwargs:
                return fast
            # Plain parameters by keyword, none of them also given by position (the names are
            # distinct, so the dict grew by every keyword argument exactly when none was).
            if self._positional_set.issuperset(kwargs):
                fast.update(kwargs)
                if len(fast) == given + len(kwargs):
                    return fast
        try:
            return dict(self.signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            return {"args": list(args), "kwargs": kwargs}

    def _call(
        self,
        invocation_id: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        exactly_once: bool,
    ) -> R:
        ctx = current_agent()
        if ctx is None:
            # Outside any agent nothing is captured and nothing is deduplicated.
            return self.fn(*args, **kwargs)
        if ctx.cancelled_reason is not None or ctx.deadline is not None or ctx.enclosing:
            # Raises when this execution, or one it runs inside, failed or timed out.
            ctx.check_active()
        # The input as JSON: with the tool, the identity of the call (compared in canonical form)
        # and, cut to the payload limit, its recorded arguments.
        arguments = jsonsafe.dumps_str_keyed(self._arguments(args, kwargs), _UNBOUNDED)
        if invocation_id is None:
            return self._run_new(ctx, None, None, arguments, args, kwargs)
        key = (ctx.run_id, ctx.agent_id, invocation_id)
        if self.is_async:
            return cast(R, self._call_async(ctx, key, arguments, args, kwargs, exactly_once))
        while True:
            entry, owner = invocations.claim(key, self.identity, arguments, exactly_once)
            if owner:
                entry.runner = threading.get_ident()
                ledger = tool_ledger() if exactly_once else None
                if ledger is not None and self._claim_in_ledger(ledger, ctx, key, entry):
                    return cast(R, _replay(entry))
                return self._run_new(ctx, key, entry, arguments, args, kwargs)
            if not entry.done and entry.runner == threading.get_ident():
                raise _called_inside_itself(key[2])
            invocations.wait(entry)
            if not entry.interrupted:
                return cast(R, _replay(entry))

    async def _call_async(
        self,
        ctx: AgentContext,
        key: Key,
        arguments: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        exactly_once: bool,
    ) -> Any:
        while True:
            entry, owner = invocations.claim(key, self.identity, arguments, exactly_once)
            if owner:
                entry.runner = asyncio.current_task()
                ledger = tool_ledger() if exactly_once else None
                if ledger is not None and await self._aclaim_in_ledger(ledger, ctx, key, entry):
                    return _replay(entry)
                return await cast(
                    Awaitable[Any], self._run_new(ctx, key, entry, arguments, args, kwargs)
                )
            if not entry.done and entry.runner is asyncio.current_task():
                raise _called_inside_itself(key[2])
            while not entry.done:
                await asyncio.to_thread(invocations.wait, entry, 0.5)
            if not entry.interrupted:
                return _replay(entry)

    # ------------------------------------------------------------- the ledger

    def _ledger_call(self, key: Key, entry: _Invocation) -> LedgerCall:
        return LedgerCall(
            key[0],
            key[1],
            key[2],
            self.name,
            call_digest(self.identity, canonical(entry.arguments)),
            self.crash_policy,
        )

    def _take_claim(self, key: Key, entry: _Invocation, claim: LedgerClaim) -> bool | None:
        """Act on the ledger's answer: True when ``entry`` now holds a recorded outcome, False
        when the caller runs the body, None when another process runs it (ask again)."""
        call = entry.ledger_call
        assert call is not None
        if claim.state == "claimed":
            entry.attempt = claim.attempt
            entry.ordinal = claim.ordinal
            return False
        if claim.state == "running":
            return None
        entry.ledger_call = None  # an outcome recorded elsewhere: nothing of ours to complete
        if claim.state == "succeeded":
            codec = codec_named(claim.codec)
            if codec is None:
                entry.error = rebuild_error(
                    {
                        "module": "builtins",
                        "qualname": "LookupError",
                        "message": f"the result was recorded with codec {claim.codec!r}, which "
                        "this process does not know",
                    },
                    key[2],
                    self.name,
                )
            else:
                entry.result = codec.decode(claim.result)
        elif claim.state == "failed":
            entry.error = rebuild_error(claim.error, key[2], self.name)
        else:
            entry.error = ToolOutcomeUnknown(key[2], self.name, claim.attempt)
        entry.attempt = claim.attempt
        entry.ordinal = claim.ordinal
        if claim.result_event_id is not None and claim.result_event_seq is not None:
            entry.result_event = EventRef(claim.result_event_id, claim.result_event_seq, key[1])
        invocations.complete(key, entry)
        return True

    def _claim_in_ledger(
        self, ledger: ToolLedger, ctx: AgentContext, key: Key, entry: _Invocation
    ) -> bool:
        """Claim the call in the ledger, waiting (polling with backoff, holding no connection)
        while another process runs it. Returns True when ``entry`` holds an outcome recorded
        there, False when this caller runs the body (claimed, or the ledger unavailable)."""
        entry.ledger_call = self._ledger_call(key, entry)
        delays = _poll_delays()
        try:
            while True:
                try:
                    claim = ledger.claim(entry.ledger_call)
                except Exception as error:
                    if getattr(error, "fatal", False):
                        raise
                    ledger_state.failed(error)
                    entry.ledger_call = None
                    return False
                ledger_state.ok()
                taken = self._take_claim(key, entry, claim)
                if taken is not None:
                    return taken
                ctx.check_active()
                time.sleep(next(delays))
        except BaseException as error:
            if not isinstance(error, Exception) and entry.ledger_call is not None:
                _withdraw_interrupted(ledger, entry.ledger_call)
            invocations.release(key, entry)
            raise

    async def _aclaim_in_ledger(
        self, ledger: ToolLedger, ctx: AgentContext, key: Key, entry: _Invocation
    ) -> bool:
        """:meth:`_claim_in_ledger` for async tools: the ledger is asked in a worker thread and
        waited for with ``asyncio.sleep``, so the event loop keeps running."""
        entry.ledger_call = self._ledger_call(key, entry)
        delays = _poll_delays()
        try:
            while True:
                try:
                    claim = await _claim_in_thread(ledger, entry.ledger_call)
                except Exception as error:
                    if getattr(error, "fatal", False):
                        raise
                    ledger_state.failed(error)
                    entry.ledger_call = None
                    return False
                ledger_state.ok()
                taken = self._take_claim(key, entry, claim)
                if taken is not None:
                    return taken
                ctx.check_active()
                await asyncio.sleep(next(delays))
        except BaseException:
            invocations.release(key, entry)
            raise

    # ------------------------------------------------------------- running the body

    def _run_new(
        self,
        ctx: AgentContext,
        key_: Key | None,
        entry: _Invocation | None,
        arguments: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> R:
        # ctx.is_cancelled(), called only when one of the fields it reads is set (most calls set
        # none of them, and the call is a function call more).
        if (
            ctx.cancelled_reason is not None or ctx.deadline is not None or ctx.enclosing
        ) and ctx.is_cancelled():
            # The agent timed out or failed while the call was being claimed (in the ledger, or
            # waiting for another caller of the same id): the body must not start after the
            # agent_error. The claim is given back, as for a caller interrupted there.
            if key_ is not None and entry is not None:
                call = entry.ledger_call
                ledger = tool_ledger()
                if call is not None and ledger is not None:
                    try:
                        _release_unstarted(ledger, call, entry.attempt)
                    except Exception:
                        _logger.warning("agentcap: could not give back a claim", exc_info=True)
                    entry.ledger_call = None
                invocations.release(key_, entry)
            ctx.check_active()
        invocation_id = key_[2] if key_ is not None else None
        key = None
        head_extra = ""
        if invocation_id is not None and entry is not None:
            # Another call under a reused id, or a re-run after an interrupted attempt, is an
            # operation of its own with its own events. U+001F cannot occur in an invocation id,
            # so these keys never meet a user's id.
            key = f"tool:{invocation_id}"
            attempt = entry.attempt
            if entry.ordinal:
                key = f"{key}\x1fcall{entry.ordinal}"
                head_extra = f',"id_reuse":{entry.ordinal}'
            if attempt != 1:
                key = f"{key}\x1fattempt{attempt}"
                head_extra = f'{head_extra},"attempt":{attempt}'
        result_id = None
        # stamp() and Stamp.attributes() inlined: the same sequence, id and attributes, in the
        # same order (the causal parents bound with caused_by as stamp() takes them).
        ambient = ambient_causal_parents()
        shared = ambient_parents(ambient) if ambient else None
        seq = ctx.clock.tick(shared.after if shared is not None else 0)
        agent_id = ctx.agent_id
        idempotency_key = f"seq:{seq}" if key is None else f"{key}:invocation"
        event_id = event_id_in(ctx.event_id_prefix, idempotency_key)
        if key is not None:
            # The result's id too, now, while the hash's code is in the instruction cache
            # (its key is known; without a key it names the result's sequence, not known yet).
            result_id = event_id_in(ctx.event_id_prefix, f"{key}:result")
        span_attributes: dict[str, AttributeValue] = {
            attr.RUN_ID: ctx.run_id,
            attr.AGENT_ID: agent_id,
            attr.GEN_AI_AGENT_ID: agent_id,
            attr.GEN_AI_AGENT_NAME: ctx.name,
            attr.EVENT_ID: event_id,
            attr.EVENT_TYPE: EventType.TOOL_INVOCATION,
            attr.EVENT_SEQ: seq,
        }
        if key is not None:  # never "seq:{seq}", which the stamp leaves out
            span_attributes[attr.EVENT_IDEMPOTENCY_KEY] = idempotency_key
        if shared is not None:
            span_attributes[attr.EVENT_CAUSAL_PARENT_IDS] = shared.ids
            links = new_links(shared.linked) if shared.linked else ()
        else:
            links = ()
        invocation = _new_ref((event_id, seq, agent_id, None))
        span_attributes[attr.GEN_AI_OPERATION_NAME] = attr.OP_EXECUTE_TOOL
        call_id = invocation_id if invocation_id is not None else f"seq-{seq}"
        # The invocation id is escaped once and used in both payloads.
        head = f"{self._payload_prefix}{tel.json_string(call_id)}{head_extra}"
        recorded = (
            arguments
            if len(arguments) <= jsonsafe.DEFAULT_MAX_PAYLOAD_CHARS
            else jsonsafe.truncate(arguments)
        )
        span_attributes[attr.EVENT_PAYLOAD] = (
            f'{head},"arguments":{recorded}}}'  # tel.tool_payload, the value encoded already
        )
        if tel.content.enabled:
            span_attributes[attr.GEN_AI_TOOL_CALL_ARGUMENTS] = recorded
        span_attributes.update(self._span_attributes)
        span_attributes[attr.GEN_AI_TOOL_CALL_ID] = call_id
        # The current context, read once: the span's parent (what the SDK would read three
        # times, through get_current_span) and the context the span is made current in.
        var = tel.context_var
        parent = var.get() if var is not None else None
        # The span starts with the event id (what span processors' on_start look for: the span is
        # stamped already) and gen_ai.operation.name (sampling-relevant in the GenAI
        # conventions); every attribute is in it, in the order above, right after, before the
        # body runs. The SDK cleans each attribute given to start_span in Python (about 6,500
        # instructions each in a callgrind count); these are plain values that need none.
        span = tel.start_span(
            self._span_name,
            {attr.EVENT_ID: event_id, attr.GEN_AI_OPERATION_NAME: attr.OP_EXECUTE_TOOL},
            links,
            context=parent,
        )
        try:
            add_attributes(span, span_attributes, in_order=True)  # set_attributes_in_order
        except Exception:
            _logger.exception("agentcap: could not record the call of %s", self.name)
        if entry is not None:
            entry.invocation_event = invocation
        finisher = _new_finisher(
            (ctx, self, call_id, head, key, span, invocation, key_, entry, arguments, result_id)
        )
        if self.is_async:
            return cast(R, self._run_async(finisher, span, args, kwargs))
        # attach(set_span_in_context(span)) and detach(token), through the variable behind them
        # when it is known (see tel.context_var).
        if not self.current_span:
            token = None
        elif parent is not None:
            token = var.set(Context({**parent, tel.SPAN_KEY: span}))  # type: ignore[union-attr]
        else:
            token = otel_context.attach(trace.set_span_in_context(span))
        current = _current_invocation.set(finisher)
        try:
            result = self.fn(*args, **kwargs)
        except BaseException as error:
            _current_invocation.reset(current)
            if token is not None:
                otel_context.detach(token)
            finisher.failed(error)
            raise
        _current_invocation.reset(current)
        if token is not None:
            if parent is not None:
                var.reset(token)  # type: ignore[union-attr]
            else:
                otel_context.detach(token)
        if type(result) in _GENERATOR_TYPES:
            # A sync wrapper around a generator function: its body would run as the caller
            # iterates, after the outcome was recorded (outside the agent, maybe). Refused, as a
            # generator function is, inside the call, which records the error.
            kind = deferred_kind(result)
            close_unrun(result)
            refused = TypeError(
                f"tool {self.name!r} returned a {kind}: its body would run as the caller "
                "iterates, after the call has returned and its outcome was recorded; return the "
                "items (a list) instead"
            )
            finisher.failed(refused)
            raise refused
        if type(result) is types.CoroutineType:
            # A sync function that returned a coroutine (a wrapper around an async function):
            # its body runs when the caller awaits it, so the call is recorded there, and this
            # tool's later calls take the async path.
            self.is_async = True
            body = cast(Coroutine[Any, Any, Any], result)
            running = self._run_async(finisher, span, args, kwargs, body)
            weakref.finalize(running, _unless_awaited, finisher, body)
            return cast(R, running)
        finisher.succeeded(result)
        return result

    async def _run_async(
        self,
        finisher: _Finisher,
        span: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        started: Awaitable[Any] | None = None,
    ) -> Any:
        if started is not None and finisher.entry is not None:
            finisher.entry.runner = asyncio.current_task()
        token = otel_context.attach(trace.set_span_in_context(span)) if self.current_span else None
        current = _current_invocation.set(finisher)
        try:
            awaitable = started if started is not None else self.fn(*args, **kwargs)
            # A tool seen returning a coroutine once may return a plain value on another call.
            result = await awaitable if inspect.isawaitable(awaitable) else awaitable
        except BaseException as error:
            _current_invocation.reset(current)
            if token is not None:
                otel_context.detach(token)
            finisher.failed(error)
            raise
        _current_invocation.reset(current)
        if token is not None:
            otel_context.detach(token)
        finisher.succeeded(result)
        return result


def _unless_awaited(finisher: _Finisher, body: Coroutine[Any, Any, Any]) -> None:
    """Called when the awaitable a call returned for a coroutine its tool's function returned is
    collected: if it was never awaited, the body never ran, and the call ends as interrupted (its
    claim released, so a retry runs it) instead of holding its claim forever."""
    if inspect.getcoroutinestate(body) == inspect.CORO_CREATED:
        body.close()
        finisher.failed(asyncio.CancelledError("the call's awaitable was never awaited"))


class _Finisher(NamedTuple):
    """Records the outcome of one invocation (a NamedTuple: one is built per call, in C)."""

    ctx: AgentContext
    tool: Tool[..., Any]
    call_id: str
    #: The start of both payloads: tool name and invocation id, encoded.
    payload_head: str
    key: str | None
    span: Any
    invocation: EventRef
    registry_key: Key | None
    entry: _Invocation | None
    #: The call's input as JSON.
    arguments: str
    #: The id of the tool_result event when computed with the invocation's (a call with a key),
    #: else None.
    result_id: str | None

    def succeeded(self, result: Any) -> None:
        ctx = self.ctx
        key = self.key
        invocation = self.invocation
        span = self.span
        # stamp(parents=(invocation,), link=False) and tel.outcome_record inlined: the same
        # sequence, id and record (the parents: the invocation, then those bound with caused_by).
        ambient = ambient_causal_parents()
        if ambient:
            shared = ambient_parents(ambient)
            after = shared.after
            seq = ctx.clock.tick(after if after > invocation.seq else invocation.seq)
            tail = shared.ids_json_tail
            if invocation.event_id in shared.ids:  # named twice: listed once, first
                tail = "".join(f'","{i}' for i in shared.ids if i != invocation.event_id)
        else:
            seq = ctx.clock.tick(invocation.seq)
            tail = ""
        idempotency_key = f"seq:{seq}" if key is None else f"{key}:result"
        event_id = self.result_id or event_id_in(ctx.event_id_prefix, idempotency_key)
        encoded, plain = jsonsafe.dumps_plain(result)
        payload = f'{self.payload_head},"result":{encoded}}}'  # tel.tool_payload, encoded
        record = (
            f'{{"id":"{event_id}","type":"tool_result","seq":{seq},'
            f'"key":{tel.json_ascii(idempotency_key)},'
            f'"parents":["{invocation.event_id}{tail}"],"payload":{payload}}}'
        )
        # tel.finish_span without links or error, the closing attributes built already.
        try:
            if tel.content.enabled:
                add_attributes(span, {attr.OUTCOME: record, attr.GEN_AI_TOOL_CALL_RESULT: encoded})
            else:
                add_attributes(span, {attr.OUTCOME: record})
        except Exception:
            _logger.exception("agentcap: could not record tool_result")
        try:
            span.end()
        except Exception:
            _logger.exception("agentcap: could not end span")
        entry = self.entry
        if entry is None:
            return
        kept = None
        if plain and type(result) in _FREEZABLE:
            try:  # values.frozen, inlined
                kept = marshal.dumps(result)
            except Exception:
                kept = None
        if kept is not None:
            entry.frozen_result = kept
        else:
            entry.result = private_copy(result)
        agent_id = ctx.agent_id
        entry.result_event = _new_ref((event_id, seq, agent_id, span.get_span_context()))
        call = entry.ledger_call
        if call is not None:
            try:
                encoded = self.tool.codec.encode(result)
                codec = self.tool.codec.name
            except Exception:
                _logger.warning(
                    "agentcap: codec %r could not encode the result of %s; recorded in the payload "
                    "encoding",
                    self.tool.codec.name,
                    self.call_id,
                    exc_info=True,
                )
                encoded, codec = JSON_CODEC.encode(result), JSON_CODEC.name
            _complete(
                call, entry, _new_ref((event_id, seq, agent_id, None)), True, encoded, None, codec
            )
        assert self.registry_key is not None
        invocations.complete(self.registry_key, entry)

    def failed(self, error: BaseException) -> None:
        failed = stamp(
            self.ctx,
            EventType.AGENT_ERROR,
            key=None if self.key is None else f"{self.key}:error",
            parents=(self.invocation,),
            link=False,
        )
        payload = tel.error_payload(error, tool=self.tool.name, invocation_id=self.call_id)
        tel.finish_span(self.span, failed, payload, error)
        entry = self.entry
        if entry is None:
            return
        assert self.registry_key is not None
        call = entry.ledger_call
        if isinstance(error, Exception):
            entry.error = _stored_error(error)
            entry.result_event = failed.ref_on(self.span.get_span_context())
            if call is not None:
                _complete(call, entry, failed.ref, False, None, encode_error(error), "json")
            invocations.complete(self.registry_key, entry)
        else:
            # Cancelled or interrupted, not failed. The next call runs the tool again, unless it
            # runs at most once: the body may have acted, so its outcome is unknown.
            if call is not None:
                ledger = tool_ledger()
                if ledger is not None:
                    ledger.release(call, entry.attempt)
            if self.tool.crash_policy == "at_most_once":
                assert self.registry_key is not None
                entry.error = ToolOutcomeUnknown(
                    self.registry_key[2],
                    self.tool.name,
                    entry.attempt,
                    ToolOutcomeUnknown.INTERRUPTED,
                )
                entry.result_event = failed.ref_on(self.span.get_span_context())
                invocations.complete(self.registry_key, entry)
            else:
                invocations.release(self.registry_key, entry)


def _complete(
    call: LedgerCall,
    entry: _Invocation,
    result_event: EventRef,
    succeeded: bool,
    result: Any,
    error: Any,
    codec: str,
) -> None:
    ledger = tool_ledger()
    if ledger is None:
        return
    invocation = entry.invocation_event
    ledger.complete(
        call,
        entry.attempt,
        succeeded=succeeded,
        result=result,
        error=error,
        codec=codec,
        invocation_event_id=invocation.event_id if invocation is not None else "",
        result_event_id=result_event.event_id,
        result_event_seq=result_event.seq,
    )


_new_finisher = from_fields(_Finisher)
_new_ref = from_fields(EventRef)


@overload
def tool(fn: Callable[P, R], /) -> Tool[P, R]: ...


@overload
def tool(
    *,
    name: str | None = None,
    crash_policy: CrashPolicy = DEFAULT_CRASH_POLICY,
    codec: Codec | None = None,
) -> Callable[[Callable[P, R]], Tool[P, R]]: ...


def tool(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    crash_policy: CrashPolicy = DEFAULT_CRASH_POLICY,
    codec: Codec | None = None,
) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
    """Decorate a sync or async function as a captured tool: ``@tool`` or
    ``@tool(name=..., crash_policy=..., codec=...)`` (see :class:`Tool`)."""
    if fn is not None:
        return Tool(fn, name, crash_policy=crash_policy, codec=codec)

    def decorate(inner: Callable[P, R]) -> Tool[P, R]:
        return Tool(inner, name, crash_policy=crash_policy, codec=codec)

    return decorate
