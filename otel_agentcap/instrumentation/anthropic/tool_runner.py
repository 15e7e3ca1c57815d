"""The SDK's tool-running paths through captured tools: the Messages tool runner
(``client.beta.messages.tool_runner(...)``), its toolsets, and the Sessions tool runner
(``client.beta.sessions.events.tool_runner(...)``).

Each hook hands the SDK a stand-in whose ``call`` runs the tool as a captured
:class:`otel_agentcap.Tool` with the tool_use id as invocation id, under ``caused_by(<the
model call that asked for it>)`` when that call is in the log, and afterwards indexes the result
(or error) event under the tool_use id, exactly as :func:`~otel_agentcap.run_tool_uses` does, so
the request that carries the tool_result block names it. The hooks:

* ``_run_tool(tool, tool_use)`` of ``BaseSyncToolRunner`` / ``BaseAsyncToolRunner``
  (``anthropic.lib.tools._beta_runner``): every function tool (``@beta_tool``, the memory tool,
  MCP tools) the Messages runner runs, plain, streaming and eager;
* ``tool_result(tool_use)`` of ``BetaRunnableToolset`` / ``BetaAsyncRunnableToolset``: the one
  place a toolset member runs, for the Messages runner (``_run_toolset_member`` calls it) and for
  a loop of the user's own; the member's ``call(context, name, input)`` becomes the captured body;
* ``_run_toolset_member(tool_use)`` of the two runners only binds the model call that asked for the
  member (the runner knows it also while the reply still streams, with ``run_tools_eagerly``);
* ``_call_tool(tool, event, input)`` of ``SessionToolRunner``
  (``anthropic.lib.tools._beta_session_runner``): every tool the Sessions runner runs for an
  ``agent.tool_use`` / ``agent.custom_tool_use`` event; the invocation id is the event's id. The
  model call that asked for it ran on the server, so no event of the local log stands for it.

The SDK's tool spans stay (plain spans with the agent's identity); each captured ``execute_tool``
span is a child of one and the only carrier of the tool_invocation / tool_result (or agent_error)
events. It is not made current: the spans a tool starts stay children of the SDK's tool span.

Capture records every execution the SDK makes, as the SDK makes it: a tool the SDK runs again
(after the caller appended or changed messages, a deferred call, a second runner or toolset
answering the same tool_use id) runs again and is recorded as the next attempt of its invocation
(:meth:`otel_agentcap.Tool.run_again`). Exactly-once (a repeated run of the same tool_use id, tool
and input in the same agent returns the recorded outcome, across processes with the tool ledger)
is an opt-in: :func:`exactly_once` for one runner or toolset, or for all of them
``AnthropicInstrumentor().instrument(exactly_once_tools=True)`` /
:func:`set_exactly_once_default`. Outside an agent, or for anything a hook does not recognise, the
SDK runs unchanged; capture failures are logged, never raised.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import keyword
import logging
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

from otel_agentcap import attributes as attr
from otel_agentcap import private_parts
from otel_agentcap.capture.tool_uses import (
    remember_tool_result,
    sdk_tools_exactly_once,
    set_sdk_tools_exactly_once,
    tool_use_scope,
)
from otel_agentcap.capture.tools import Tool
from otel_agentcap.context import current_agent
from otel_agentcap.instrumentation.anthropic.wrappers import ObjectProxy
from otel_agentcap.model import EventRef, EventType, validate_id

__all__ = [
    "RUNNERS",
    "RUNNER_MODULE",
    "SESSION_RUN",
    "SESSION_RUNNER",
    "SESSION_RUNNER_MODULE",
    "TOOLSETS",
    "TOOLSET_MODULE",
    "exactly_once",
    "run_tool_wrapper",
    "session_call_tool_wrapper",
    "session_runner_class",
    "set_exactly_once_default",
    "toolset_member_wrapper",
    "toolset_result_wrapper",
]

_logger = logging.getLogger(__name__)

#: Where the SDK's Messages tool runners live, and their base classes (name, is_async).
RUNNER_MODULE = "anthropic.lib.tools._beta_runner"
RUNNERS: tuple[tuple[str, bool], ...] = (
    ("BaseSyncToolRunner", False),
    ("BaseAsyncToolRunner", True),
)
#: Where the SDK exports its runnable toolset base classes (name, is_async).
TOOLSET_MODULE = "anthropic.lib.tools"
TOOLSETS: tuple[tuple[str, bool], ...] = (
    ("BetaRunnableToolset", False),
    ("BetaAsyncRunnableToolset", True),
)
#: The Sessions tool runner (async only).
SESSION_RUNNER_MODULE = "anthropic.lib.tools._beta_session_runner"
SESSION_RUNNER = "SessionToolRunner"
#: Where anthropic 2.16 and later run a session's tool calls (one per attachment to a session).
SESSION_RUN = "SessionRun"


def session_runner_class() -> str:
    """The class of the installed SDK whose ``_call_tool`` runs a session's tool calls."""
    try:
        module = importlib.import_module(SESSION_RUNNER_MODULE)
    except ImportError:
        return SESSION_RUNNER
    return (
        SESSION_RUN if hasattr(getattr(module, SESSION_RUN, None), "_call_tool") else SESSION_RUNNER
    )


Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
Scope = Callable[[], AbstractContextManager[None]]

#: The runner whose ``_run_toolset_member`` is running, for the toolset hook below it.
_member_runner: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "agentcap_member_runner", default=None
)
#: Runners and toolsets opted in (or out) one by one, weakly held.
_chosen: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def set_exactly_once_default(enabled: bool) -> None:
    """Whether the SDK's tool runners and toolsets run each tool_use exactly once (a repeated run of
    the same tool_use id, tool and input in the same agent returns the recorded outcome) unless a
    runner or toolset says otherwise with :func:`exactly_once`. Off by default: capture then
    records every execution the SDK makes, as it makes it."""
    set_sdk_tools_exactly_once(enabled)


def exactly_once(runner_or_toolset: Any, enabled: bool = True) -> Any:
    """Opt one tool runner (``client.beta.messages.tool_runner(...)``, the Sessions runner) or one
    runnable toolset in (or, with ``enabled=False``, out) of exactly-once tool runs; returns it::

        runner = exactly_once(client.beta.messages.tool_runner(model=..., tools=[...], ...))
    """
    try:
        _chosen[runner_or_toolset] = bool(enabled)
    except TypeError:
        # Not weakly referenceable, or not hashable: the choice goes on the object itself.
        try:
            object.__setattr__(runner_or_toolset, _CHOICE_ATTRIBUTE, bool(enabled))
        except (AttributeError, TypeError) as exc:
            raise TypeError(
                f"a {type(runner_or_toolset).__name__} cannot be opted in: it can be neither "
                "weakly referenced nor given an attribute"
            ) from exc
    return runner_or_toolset


_CHOICE_ATTRIBUTE = "_agentcap_exactly_once"


def _wants_exactly_once(*owners: Any) -> bool:
    for owner in owners:
        if owner is None:
            continue
        try:
            chosen = _chosen.get(owner)
        except TypeError:
            chosen = None
        if chosen is None:
            chosen = getattr(owner, _CHOICE_ATTRIBUTE, None)
        if chosen is not None:
            return bool(chosen)
    return sdk_tools_exactly_once()


class _Call(NamedTuple):
    """One tool run, prepared for capture: the arguments to call the SDK with."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tool_use_id: str
    scope: Scope


class _CapturedRunnable(ObjectProxy):
    """The SDK tool as its runner sees it, whose ``call(input)`` goes through a captured
    :class:`Tool` (``isinstance`` checks still see the SDK tool)."""

    def __init__(
        self,
        wrapped: Any,
        captured: Tool[..., Any],
        tool_use_id: str,
        once: bool,
        given: list[object],
    ) -> None:
        super().__init__(wrapped)
        self._self_captured = captured
        self._self_tool_use_id = tool_use_id
        self._self_once = once
        self._self_given = given

    def call(self, input: object) -> Any:
        if not isinstance(input, Mapping):
            return self.__wrapped__.call(input)
        self._self_given[:] = [input]
        captured = self._self_captured
        run = captured.invoke if self._self_once else captured.run_again
        return run(self._self_tool_use_id, **input)


class _CapturedToolset(ObjectProxy):
    """A toolset as its own ``tool_result`` sees it, whose ``call(context, name, input)`` for the
    one member tool_use goes through a captured :class:`Tool` around the toolset's ``call``."""

    def __init__(self, wrapped: Any, tool_use: Any, *, is_async: bool, once: bool) -> None:
        super().__init__(wrapped)
        self._self_tool_use = tool_use
        self._self_is_async = is_async
        self._self_once = once

    def call(self, context: Any, name: Any, input: Any) -> Any:
        tool_use = self._self_tool_use
        toolset = self.__wrapped__
        if (
            getattr(getattr(context, "tool_use", None), "id", None) != tool_use.id
            or name != tool_use.name
            or not isinstance(input, Mapping)
        ):
            return toolset.call(context, name, input)

        def run(arguments: dict[str, Any]) -> Any:
            return toolset.call(context, name, arguments)

        try:
            # The toolset is part of the tool's identity: another toolset answering the same
            # tool_use id is another call.
            captured = _captured_tool(
                name,
                input,
                run,
                is_async=self._self_is_async,
                identity=f"{_toolset_identity(toolset)}.{name}",
            )
        except Exception:
            _logger.debug("agentcap: could not capture toolset member %r", name, exc_info=True)
            return toolset.call(context, name, input)
        invoke = captured.invoke if self._self_once else captured.run_again
        return invoke(tool_use.id, **input)


def _toolset_identity(toolset: Any) -> str:
    """The toolset's name as a tool identity: its ``toolset_name`` (or ``name``) and class."""
    label = getattr(toolset, "toolset_name", None) or getattr(toolset, "name", None)
    cls = type(toolset).__qualname__
    return f"{label}:{cls}" if isinstance(label, str) and label else cls


def _signature(tool_input: Mapping[str, Any]) -> inspect.Signature:
    """Parameters named after the input's keys, so the recorded arguments are the tool_use input
    itself (as with ``run_tool_uses`` and a function of those parameters)."""
    names = [
        name
        for name in tool_input
        if isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)
    ]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(name, kind) for name in names])


def _runs_on_worker_thread(sdk_tool: Any) -> bool:
    """The Sessions runner's rule (``run_runnable_tool``): its sync function tools run on a worker
    thread; any other tool is called and, if that returns an awaitable, awaited."""
    try:
        from anthropic.lib.tools import BetaBuiltinFunctionTool, BetaFunctionTool

        sync_classes = (BetaFunctionTool, BetaBuiltinFunctionTool)
    except ImportError:
        return not inspect.iscoroutinefunction(getattr(sdk_tool, "call", None))
    return isinstance(sdk_tool, sync_classes)


def _captured_tool(
    name: str,
    tool_input: Mapping[str, Any],
    run: Callable[[dict[str, Any]], Any],
    *,
    is_async: bool,
    identity: str | None = None,
) -> Tool[..., Any]:
    """A :class:`Tool` named ``name`` whose body is ``run(arguments)`` (the SDK's own call: its
    input validation and the user's function). Its ``execute_tool`` span is not made current, so
    the spans the tool starts stay children of the SDK's tool span. ``identity`` (default
    ``name``) is the tool as exactly-once tells calls apart."""
    if is_async:

        async def run_async(**arguments: Any) -> Any:
            # Awaited when it returns an awaitable, as the SDK does: a tool whose ``call`` is a
            # plain method may still return a coroutine.
            result = run(arguments)
            return await result if inspect.isawaitable(result) else result

        body: Callable[..., Any] = run_async
    else:

        def run_sync(**arguments: Any) -> Any:
            return run(arguments)

        body = run_sync
    body.__name__ = name
    body.__qualname__ = name
    body.__doc__ = None
    body.__signature__ = _signature(tool_input)  # type: ignore[attr-defined]
    captured = Tool(body, name)
    captured.current_span = False
    if identity is not None and identity != name:
        captured.identity = validate_id(identity[:200], "tool identity")
    return captured


def _streaming_model_call(runner: Any) -> Callable[[], EventRef | None]:
    """For a tool run while the reply that asked for it still streams (``run_tools_eagerly``):
    the model call of that reply, read from the stamps of the SDK's still open span."""

    # Beware: private parts of the SDK's streaming (anthropic 2.14 and 2.15 tested): the
    # ``MessageStream`` behind the runner's pending ``get_final_message``, its ``_raw_stream``,
    # and the tracing recorder ``streamed_message(raw_stream)`` (module
    # ``anthropic.lib._tracing._streaming``) whose ``_span`` is the reply's open span; nothing
    # public reaches the span of a reply still streaming. Missing: one warning, and a tool run
    # eagerly has no model call as causal parent.
    def find() -> EventRef | None:
        try:
            ctx = current_agent()
            final_message = getattr(runner, "_last_message", None)
            message_stream = getattr(final_message, "__self__", None)
            raw_stream = getattr(message_stream, "_raw_stream", None)
            if ctx is None:
                return None
            try:
                from anthropic.lib._tracing._streaming import streamed_message
            except ImportError:
                _streaming_parts_missing()
                return None
            if raw_stream is None:
                _streaming_parts_missing()
                return None
            recorder = streamed_message(raw_stream)
            if not hasattr(recorder, "_span"):
                _streaming_parts_missing()
            span = getattr(recorder, "_span", None)
            attributes = getattr(span, "attributes", None) or {}
            event_id = attributes.get(attr.EVENT_ID)
            seq = attributes.get(attr.EVENT_SEQ)
            agent_id = attributes.get(attr.AGENT_ID)
            if (
                attributes.get(attr.EVENT_TYPE) != EventType.MODEL_CALL
                or attributes.get(attr.RUN_ID) != ctx.run_id
                or not isinstance(event_id, str)
                or not isinstance(seq, int)
                or not isinstance(agent_id, str)
            ):
                return None
            span_context = span.get_span_context() if span is not None else None
            return EventRef(event_id, seq, agent_id, span_context)
        except Exception:
            _logger.debug("agentcap: could not find a streaming model call", exc_info=True)
            return None

    return find


def _streaming_parts_missing() -> None:
    private_parts.missing(
        "anthropic",
        "MessageStream._raw_stream or the tracing recorder's _span",
        "tools run while their reply streams (run_tools_eagerly) do not name its model call",
    )


def _runner_scope(runner: Any, tool_use_id: str) -> Scope:
    """``caused_by(<the model call of the runner's last reply>)``, for a tool_use of that reply:
    found by the reply's response id, or from its still open span while it streams.

    Beware: ``_last_message`` is the runner's private record of its last reply (the message, or
    while it streams the bound ``get_final_message`` of its ``MessageStream``); the runner has no
    public accessor for the reply a tool_use came from. Tested at anthropic 2.14 and 2.15. Missing:
    one warning, and the tool runs without the model call as causal parent.
    """
    if not hasattr(runner, "_last_message"):
        private_parts.missing(
            "anthropic",
            "ToolRunner._last_message",
            "tools run by the SDK's tool runner do not name the model call that asked for them",
        )
    last = getattr(runner, "_last_message", None)
    message = None if callable(last) else last
    pending = _streaming_model_call(runner) if callable(last) else None
    return lambda: tool_use_scope(tool_use_id, message, pending)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _replace(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if name in kwargs:
        return args, {**kwargs, name: value}
    return (*args[:index], value, *args[index + 1 :]), kwargs


def _prepare_tool(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    tool_name: str,
    use_name: str,
    is_async: bool | None,
    once: bool,
) -> tuple[tuple[Any, ...], dict[str, Any], str] | None:
    """Arguments of a ``(tool, tool_use-or-event, ...)`` method with the SDK tool replaced by a
    captured stand-in, and the tool_use id; None for anything not recognised. ``is_async`` None:
    read it off the tool's ``call``."""
    sdk_tool = _argument(args, kwargs, 0, tool_name)
    tool_use = _argument(args, kwargs, 1, use_name)
    tool_use_id = getattr(tool_use, "id", None)
    tool_input = getattr(tool_use, "input", None)
    call = getattr(sdk_tool, "call", None)
    name = getattr(sdk_tool, "name", None) or getattr(tool_use, "name", None)
    if (
        sdk_tool is None
        or not callable(call)
        or not isinstance(tool_use_id, str)
        or not isinstance(name, str)
        or not isinstance(tool_input, Mapping)
    ):
        return None
    tool_use_id = validate_id(tool_use_id, "invocation_id")
    if is_async is None:
        is_async = not _runs_on_worker_thread(sdk_tool)
    # The very input object the runner hands the tool (see _CapturedRunnable.call): a tool that
    # changes it changes what the runner records afterwards, as without the instrumentation.
    given: list[object] = []

    def run(arguments: dict[str, Any]) -> Any:
        return sdk_tool.call(given[0] if given else arguments)

    captured = _captured_tool(name, tool_input, run, is_async=is_async)
    args, kwargs = _replace(
        args, kwargs, 0, tool_name, _CapturedRunnable(sdk_tool, captured, tool_use_id, once, given)
    )
    return args, kwargs, tool_use_id


def _run_captured(
    wrapped: Callable[..., Any], call: _Call | None, args: Any, kwargs: Any, *, is_async: bool
) -> Any:
    """Call ``wrapped`` with the prepared arguments inside the model call's scope, then index the
    result event; without a prepared call, call it unchanged."""
    if call is None:
        return wrapped(*args, **kwargs)
    if is_async:

        async def run() -> Any:
            with call.scope():
                result = await wrapped(*call.args, **call.kwargs)
            remember_tool_result(call.tool_use_id)
            return result

        return run()
    with call.scope():
        result = wrapped(*call.args, **call.kwargs)
    remember_tool_result(call.tool_use_id)
    return result


# ----------------------------------------------------------------- Messages tool runner


def run_tool_wrapper(*, is_async: bool) -> Wrapper:
    """Wraps a Messages tool runner's ``_run_tool(tool, tool_use)``."""

    def prepare(runner: Any, args: Any, kwargs: Any) -> _Call | None:
        try:
            if current_agent() is None:
                return None
            prepared = _prepare_tool(
                args,
                kwargs,
                tool_name="tool",
                use_name="tool_use",
                is_async=is_async,
                once=_wants_exactly_once(runner),
            )
            if prepared is None:
                return None
            new_args, new_kwargs, tool_use_id = prepared
            return _Call(new_args, new_kwargs, tool_use_id, _runner_scope(runner, tool_use_id))
        except Exception:
            _logger.debug("agentcap: could not capture a tool run of the runner", exc_info=True)
            return None

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        call = prepare(instance, args, kwargs)
        return _run_captured(wrapped, call, args, kwargs, is_async=is_async)

    return wrapper


def toolset_member_wrapper(*, is_async: bool) -> Wrapper:
    """Wraps a Messages tool runner's ``_run_toolset_member(tool_use)``: binds the model call of
    the runner's reply (the member itself is captured by :func:`toolset_result_wrapper`)."""

    def scope(runner: Any, args: Any, kwargs: Any) -> Scope | None:
        try:
            if current_agent() is None:
                return None
            tool_use_id = getattr(_argument(args, kwargs, 0, "tool_use"), "id", None)
            if not isinstance(tool_use_id, str):
                return None
            return _runner_scope(runner, tool_use_id)
        except Exception:
            _logger.debug("agentcap: could not find the model call of a member", exc_info=True)
            return None

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        bound = scope(instance, args, kwargs)
        if bound is None:
            return wrapped(*args, **kwargs)
        if is_async:

            async def run() -> Any:
                token = _member_runner.set(instance)
                try:
                    with bound():
                        return await wrapped(*args, **kwargs)
                finally:
                    _member_runner.reset(token)

            return run()
        token = _member_runner.set(instance)
        try:
            with bound():
                return wrapped(*args, **kwargs)
        finally:
            _member_runner.reset(token)

    return wrapper


# ----------------------------------------------------------------- toolsets


def toolset_result_wrapper(*, is_async: bool) -> Wrapper:
    """Wraps ``tool_result(tool_use)`` of a runnable toolset: the toolset's own method runs with
    a stand-in of the toolset whose ``call`` for this member runs through a captured Tool."""

    def prepare(toolset: Any, wrapped: Any, args: Any, kwargs: Any) -> _Call | None:
        try:
            if current_agent() is None:
                return None
            function = getattr(wrapped, "__func__", None)
            tool_use = _argument(args, kwargs, 0, "tool_use")
            tool_use_id = getattr(tool_use, "id", None)
            name = getattr(tool_use, "name", None)
            tool_input = getattr(tool_use, "input", None)
            if (
                function is None
                or toolset is None
                or not isinstance(tool_use_id, str)
                or not isinstance(name, str)
                or not isinstance(tool_input, Mapping)
            ):
                return None
            tool_use_id = validate_id(tool_use_id, "invocation_id")
            once = _wants_exactly_once(toolset, _member_runner.get())
            proxy = _CapturedToolset(toolset, tool_use, is_async=is_async, once=once)
            return _Call(
                (proxy, *args),
                dict(kwargs),
                tool_use_id,
                lambda: tool_use_scope(tool_use_id),
            )
        except Exception:
            _logger.debug("agentcap: could not capture a toolset member", exc_info=True)
            return None

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        call = prepare(instance, wrapped, args, kwargs)
        if call is None:
            return wrapped(*args, **kwargs)
        function: Callable[..., Any] = wrapped.__func__  # type: ignore[attr-defined]
        return _run_captured(function, call, args, kwargs, is_async=is_async)

    return wrapper


# ----------------------------------------------------------------- Sessions tool runner


def session_call_tool_wrapper() -> Wrapper:
    """Wraps ``SessionToolRunner._call_tool(tool, event, input)`` (a coroutine): the tool runs
    as invocation ``<event id>`` of a captured Tool, awaited or on the SDK's worker thread as
    before."""

    def prepare(runner: Any, args: Any, kwargs: Any) -> _Call | None:
        try:
            if current_agent() is None:
                return None
            prepared = _prepare_tool(
                args,
                kwargs,
                tool_name="tool",
                use_name="ev",
                is_async=None,
                # A SessionRun (2.16 and later) belongs to the SessionToolRunner the user made.
                once=_wants_exactly_once(runner, getattr(runner, "_runner", None)),
            )
            if prepared is None:
                return None
            new_args, new_kwargs, tool_use_id = prepared
            return _Call(new_args, new_kwargs, tool_use_id, lambda: tool_use_scope(tool_use_id))
        except Exception:
            _logger.debug("agentcap: could not capture a tool run of a session", exc_info=True)
            return None

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        call = prepare(instance, args, kwargs)
        return _run_captured(wrapped, call, args, kwargs, is_async=True)

    return wrapper
