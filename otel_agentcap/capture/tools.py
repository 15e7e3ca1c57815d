"""Captured tools: ``execute_tool`` spans, invocation and result events, and in-process
exactly-once execution per (run, agent, invocation id)."""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Generic, NamedTuple, ParamSpec, TypeVar, cast, overload

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.context import AgentContext, current_agent
from otel_agentcap.model import EventRef, EventType, from_fields, validate_id
from otel_agentcap.runs import lifetimes
from otel_agentcap.stamping import stamp

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_MAX_COMPLETED = 100_000


class _Invocation:
    """The one execution of a tool invocation; retries wait on it and share its outcome.

    Fields are class-level defaults, set on the instance only when they change: one is created
    for every captured invocation, and ``_Invocation()`` with no ``__init__`` costs next to
    nothing."""

    done: bool = False
    result: Any = None
    error: BaseException | None = None
    invocation_event: EventRef | None = None
    result_event: EventRef | None = None
    #: The owner was interrupted (cancelled, KeyboardInterrupt) before an outcome: not an
    #: outcome to replay, so waiters claim the invocation again.
    interrupted: bool = False
    attempt: int = 1
    #: What runs the body: its thread's ident (sync tools) or its asyncio task (async tools).
    runner: object = None


class InvocationRegistry:
    """Outcomes of tool invocations in this process, keyed by (run, agent, invocation id).

    Scoping by run and agent means one agent's retry never gets another agent's result.
    A run's outcomes are released when the run's last scope in this process closes
    (``runs.lifetimes``); within a run, at most ``max_completed`` finished outcomes are kept
    across all open runs (oldest forgotten first), so a long-running process does not grow
    without bound; running invocations are never evicted. Waiters share one condition instead of
    an event per invocation, which is notified only while someone waits.
    """

    def __init__(self, max_completed: int = DEFAULT_MAX_COMPLETED) -> None:
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._waiting = 0
        # Per run, so that releasing a run costs the size of that run only.
        self._runs: dict[str, dict[tuple[str, str, str], _Invocation]] = {}
        # Finished keys, oldest first. An OrderedDict, not a dict: evicting a plain dict's first
        # entry leaves a hole that every later ``next(iter(...))`` scans past until the dict
        # resizes, which made each call O(n) once the registry was full.
        self._completed: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self.max_completed = max_completed

    def complete(self, key: tuple[str, str, str], entry: _Invocation) -> None:
        """Publish the outcome stored on ``entry`` and wake the waiters."""
        with self._lock:
            entry.done = True
            entries = self._runs.get(key[0])
            if entries is not None and entries.get(key) is entry:
                completed = self._completed
                completed[key] = None
                while len(completed) > self.max_completed:
                    old, _ = completed.popitem(last=False)
                    old_entries = self._runs.get(old[0])
                    if old_entries is not None:
                        old_entries.pop(old, None)
            if self._waiting:
                self._finished.notify_all()

    def wait(self, entry: _Invocation, timeout: float | None = None) -> bool:
        """Wait until ``entry`` is done; returns whether it is."""
        with self._lock:
            if not entry.done:
                self._waiting += 1
                try:
                    self._finished.wait_for(lambda: entry.done, timeout)
                finally:
                    self._waiting -= 1
            return entry.done

    def claim(self, key: tuple[str, str, str]) -> tuple[_Invocation, bool]:
        """Return the invocation for ``key`` and whether the caller owns its execution."""
        with self._lock:
            entries = self._runs.get(key[0])
            if entries is None:
                entries = self._runs[key[0]] = {}
            entry = entries.get(key)
            if entry is not None:
                if not entry.interrupted:
                    return entry, False
                attempt = entry.attempt + 1  # the last attempt was interrupted: run it again
            else:
                attempt = 1
            entry = entries[key] = _Invocation()
            if attempt > 1:
                entry.attempt = attempt
            return entry, True

    def release(self, key: tuple[str, str, str], entry: _Invocation) -> None:
        """Give up an interrupted attempt, so the next call runs the tool again (as the next
        attempt, whose events get keys of their own)."""
        with self._lock:
            entry.interrupted = True
            entry.done = True
            if self._waiting:
                self._finished.notify_all()

    def lookup(self, key: tuple[str, str, str]) -> _Invocation | None:
        with self._lock:
            entries = self._runs.get(key[0])
            entry = entries.get(key) if entries is not None else None
            return None if entry is None or entry.interrupted else entry

    def forget_run(self, run_id: str) -> None:
        """Release the outcomes of a finished run."""
        with self._lock:
            entries = self._runs.pop(run_id, None)
            if entries:
                completed = self._completed
                for key in entries:
                    completed.pop(key, None)

    def __len__(self) -> int:
        """Invocations held (running, finished or interrupted), over all runs."""
        with self._lock:
            return sum(len(entries) for entries in self._runs.values())


invocations = InvocationRegistry()
lifetimes.on_release(invocations.forget_run)


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
            copied.__dict__.update(state)
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
    return entry.result


class Tool(Generic[P, R]):
    """A captured tool. Calling it runs the function with its own arguments, untouched; use
    :meth:`invoke` to give the invocation an id that makes retries return the recorded outcome."""

    def __init__(self, fn: Callable[P, R], name: str | None = None) -> None:
        self.fn = fn
        if name is None:
            name = getattr(fn, "__name__", None)
            if name is None:
                raise TypeError(
                    f"a {type(fn).__name__} has no __name__ to name the tool by: "
                    "use tool(name=...) or Tool(fn, name=...)"
                )
        self.name = validate_id(name, "tool name")
        self.signature = inspect.signature(fn)
        self.is_async = inspect.iscoroutinefunction(fn)
        # Names of leading plain positional parameters: binding a call that passes only those
        # (the common case) is a zip, not a full Signature.bind.
        simple: list[str] = []
        for param in self.signature.parameters.values():
            if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                break
            simple.append(param.name)
        self._positional_names = tuple(simple)
        self._positional_set = frozenset(simple)
        self._span_name = f"execute_tool {self.name}"
        self._span_attributes: dict[str, AttributeValue] = {
            attr.GEN_AI_OPERATION_NAME: attr.OP_EXECUTE_TOOL,
            attr.GEN_AI_TOOL_NAME: self.name,
            attr.GEN_AI_TOOL_TYPE: "function",
        }
        # Payloads are composed around the encoded arguments or result (tel.tool_payload).
        self._payload_prefix = f'{{"tool":{tel.json_string(self.name)},"invocation_id":'
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return Tool(cast(Callable[P, R], functools.partial(self.fn, instance)), self.name)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._call(None, args, kwargs)

    def invoke(self, invocation_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the tool as invocation ``invocation_id`` (for example a tool_use block id).

        The first call with an id runs the body; any later or concurrent call with the same id in
        the same run and agent returns the recorded result or raises the recorded error, without
        running the body again. For an async tool this returns an awaitable.
        """
        return self._call(validate_id(invocation_id, "invocation_id"), args, kwargs)

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = self._positional_names
        if len(args) <= len(names):
            fast = dict(zip(names, args, strict=False))
            if not kwargs:
                return fast
            # Plain parameters by keyword, none of them also given by position.
            if kwargs.keys() <= self._positional_set and kwargs.keys().isdisjoint(fast):
                fast.update(kwargs)
                return fast
        try:
            return dict(self.signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            return {"args": list(args), "kwargs": kwargs}

    def _call(self, invocation_id: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        ctx = current_agent()
        if ctx is None:
            # Outside any agent nothing is captured and nothing is deduplicated.
            return self.fn(*args, **kwargs)
        ctx.check_active()
        if invocation_id is None:
            return self._run_new(ctx, None, args, kwargs)
        key = (ctx.run_id, ctx.agent_id, invocation_id)
        if self.is_async:
            return cast(R, self._call_async(ctx, invocation_id, key, args, kwargs))
        while True:
            entry, owner = invocations.claim(key)
            if owner:
                entry.runner = threading.get_ident()
                return self._run_new(ctx, (key, entry), args, kwargs)
            if not entry.done and entry.runner == threading.get_ident():
                raise _called_inside_itself(invocation_id)
            invocations.wait(entry)
            if not entry.interrupted:
                return cast(R, _replay(entry))

    async def _call_async(
        self,
        ctx: AgentContext,
        invocation_id: str,
        key: tuple[str, str, str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        while True:
            entry, owner = invocations.claim(key)
            if owner:
                entry.runner = asyncio.current_task()
                return await cast(Awaitable[Any], self._run_new(ctx, (key, entry), args, kwargs))
            if not entry.done and entry.runner is asyncio.current_task():
                raise _called_inside_itself(invocation_id)
            while not entry.done:
                await asyncio.to_thread(invocations.wait, entry, 0.5)
            if not entry.interrupted:
                return _replay(entry)

    def _run_new(
        self,
        ctx: AgentContext,
        claim: tuple[tuple[str, str, str], _Invocation] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> R:
        invocation_id = claim[0][2] if claim is not None else None
        entry = claim[1] if claim is not None else None
        key = None
        if invocation_id is not None and entry is not None:
            # A re-run after an interrupted attempt is a new operation with its own events.
            # U+001F cannot occur in an invocation id, so this never meets a user's id.
            suffix = "" if entry.attempt == 1 else f"\x1fattempt{entry.attempt}"
            key = f"tool:{invocation_id}{suffix}"
        start = stamp(
            ctx, EventType.TOOL_INVOCATION, key=None if key is None else f"{key}:invocation"
        )
        call_id = invocation_id if invocation_id is not None else f"seq-{start.seq}"
        # The invocation id is escaped once and used in both payloads.
        head = f"{self._payload_prefix}{tel.json_string(call_id)}"
        attributes = start.attributes()
        if tel.content.enabled:
            encoded = jsonsafe.dumps(self._arguments(args, kwargs))
            attributes[attr.EVENT_PAYLOAD] = tel.tool_payload_encoded(head, "arguments", encoded)
            attributes[attr.GEN_AI_TOOL_CALL_ARGUMENTS] = encoded
        else:
            attributes[attr.EVENT_PAYLOAD] = tel.tool_payload(
                head, "arguments", self._arguments(args, kwargs)
            )
        attributes.update(self._span_attributes)
        attributes[attr.GEN_AI_TOOL_CALL_ID] = call_id
        span = tel.start_span(self._span_name, attributes, start.links)
        invocation = start.ref
        if entry is not None:
            entry.invocation_event = invocation
        finisher = _new_finisher((ctx, self.name, call_id, head, key, span, invocation, claim))
        if self.is_async:
            return cast(R, self._run_async(finisher, span, args, kwargs))
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            result = self.fn(*args, **kwargs)
        except BaseException as error:
            otel_context.detach(token)
            finisher.failed(error)
            raise
        otel_context.detach(token)
        finisher.succeeded(result)
        return result

    async def _run_async(
        self, finisher: _Finisher, span: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            result = await cast(Callable[..., Awaitable[Any]], self.fn)(*args, **kwargs)
        except BaseException as error:
            otel_context.detach(token)
            finisher.failed(error)
            raise
        otel_context.detach(token)
        finisher.succeeded(result)
        return result


class _Finisher(NamedTuple):
    """Records the outcome of one invocation (a NamedTuple: one is built per call, in C)."""

    ctx: AgentContext
    tool: str
    call_id: str
    #: The start of both payloads: tool name and invocation id, encoded.
    payload_head: str
    key: str | None
    span: Any
    invocation: EventRef
    claim: tuple[tuple[str, str, str], _Invocation] | None

    def succeeded(self, result: Any) -> None:
        done = stamp(
            self.ctx,
            EventType.TOOL_RESULT,
            key=None if self.key is None else f"{self.key}:result",
            parents=(self.invocation,),
            link=False,
        )
        if tel.content.enabled:
            encoded = jsonsafe.dumps(result)
            payload = tel.Encoded(tel.tool_payload_encoded(self.payload_head, "result", encoded))
            tel.finish_span(self.span, done, payload, None, {attr.GEN_AI_TOOL_CALL_RESULT: encoded})
        else:
            payload = tel.Encoded(tel.tool_payload(self.payload_head, "result", result))
            tel.finish_span(self.span, done, payload)
        if self.claim is not None:
            key, entry = self.claim
            entry.result = result
            entry.result_event = done.ref_on(self.span.get_span_context())
            invocations.complete(key, entry)

    def failed(self, error: BaseException) -> None:
        failed = stamp(
            self.ctx,
            EventType.AGENT_ERROR,
            key=None if self.key is None else f"{self.key}:error",
            parents=(self.invocation,),
            link=False,
        )
        payload = tel.error_payload(error, tool=self.tool, invocation_id=self.call_id)
        tel.finish_span(self.span, failed, payload, error)
        if self.claim is None:
            return
        key, entry = self.claim
        if isinstance(error, Exception):
            entry.error = _stored_error(error)
            entry.result_event = failed.ref_on(self.span.get_span_context())
            invocations.complete(key, entry)
        else:
            # Cancelled or interrupted, not failed: let the next call run the tool.
            invocations.release(key, entry)


_new_finisher = from_fields(_Finisher)


@overload
def tool(fn: Callable[P, R], /) -> Tool[P, R]: ...


@overload
def tool(*, name: str | None = None) -> Callable[[Callable[P, R]], Tool[P, R]]: ...


def tool(
    fn: Callable[P, R] | None = None, /, *, name: str | None = None
) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
    """Decorate a sync or async function as a captured tool: ``@tool`` or ``@tool(name=...)``."""
    if fn is not None:
        return Tool(fn, name)

    def decorate(inner: Callable[P, R]) -> Tool[P, R]:
        return Tool(inner, name)

    return decorate
