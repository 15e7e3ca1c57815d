"""The SDK's beta tool runner (``client.beta.messages.tool_runner(...)``) through captured tools.

The runner executes each function tool (``@beta_tool`` / ``@beta_async_tool``) in
``_run_tool(tool, tool_use)`` of ``BaseSyncToolRunner`` / ``BaseAsyncToolRunner`` (the plain and the
streaming runners, also the eager ``run_tools_eagerly`` path), inside the SDK's own
``anthropic.custom_tool_use {name}`` span. :func:`run_tool_wrapper` wraps that method: inside an
agent it hands the runner a stand-in of the SDK tool whose ``call(input)`` runs the tool as
:meth:`otel_agentcap.Tool.invoke` with the tool_use id as invocation id, under ``caused_by(<the
model call that asked for it>)``, and afterwards indexes the result (or error) event under the
tool_use id, exactly as :func:`~otel_agentcap.run_tool_uses` does. The runner's next request
carries the tool_result blocks, and the request wrapper names those events as its causal parents.

The SDK's span stays (a plain span with the agent's identity); the captured ``execute_tool`` span
is its child and the only carrier of the tool_invocation / tool_result (or agent_error) events. The
SDK still turns a raised error into an ``is_error`` tool_result block, and a repeated call with
the same tool_use id in the same agent returns the recorded outcome without running the tool.
Outside an agent, or for anything it does not recognise, the wrapper calls the SDK unchanged.
"""

from __future__ import annotations

import inspect
import keyword
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import wrapt

from otel_agentcap import attributes as attr
from otel_agentcap.capture.tools import Tool
from otel_agentcap.context import current_agent
from otel_agentcap.model import EventRef, EventType
from otel_agentcap.tool_uses import remember_tool_result, tool_use_scope

__all__ = ["RUNNERS", "RUNNER_MODULE", "run_tool_wrapper"]

_logger = logging.getLogger(__name__)

#: Where the SDK's Messages tool runners live, and their base classes (name, is_async).
RUNNER_MODULE = "anthropic.lib.tools._beta_runner"
RUNNERS: tuple[tuple[str, bool], ...] = (
    ("BaseSyncToolRunner", False),
    ("BaseAsyncToolRunner", True),
)

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class _Call(NamedTuple):
    """One tool run of the runner, prepared for capture."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tool_use_id: str
    scope: Callable[[], AbstractContextManager[None]]


class _CapturedRunnable(wrapt.ObjectProxy[Any]):
    """The SDK tool as the runner sees it, whose ``call`` goes through a captured :class:`Tool`."""

    def __init__(self, wrapped: Any, captured: Tool[..., Any], tool_use_id: str) -> None:
        super().__init__(wrapped)
        self._self_captured = captured
        self._self_tool_use_id = tool_use_id

    def call(self, input: object) -> Any:
        if not isinstance(input, Mapping):
            return self.__wrapped__.call(input)
        return self._self_captured.invoke(self._self_tool_use_id, **input)


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


def _captured_tool(
    sdk_tool: Any, name: str, tool_input: Mapping[str, Any], *, is_async: bool
) -> Tool[..., Any]:
    """A :class:`Tool` named ``name`` whose body is the SDK tool's own ``call`` (its validation
    and the user's function)."""
    if is_async:

        async def run_async(**arguments: Any) -> Any:
            return await sdk_tool.call(arguments)

        body: Callable[..., Any] = run_async
    else:

        def run(**arguments: Any) -> Any:
            return sdk_tool.call(arguments)

        body = run
    body.__name__ = name
    body.__qualname__ = name
    body.__doc__ = None
    body.__signature__ = _signature(tool_input)  # type: ignore[attr-defined]
    return Tool(body, name)


def _streaming_model_call(runner: Any) -> Callable[[], EventRef | None]:
    """For a tool run while the reply that asked for it still streams (``run_tools_eagerly``):
    the model call of that reply, read from the stamps of the SDK's still open span."""

    def find() -> EventRef | None:
        try:
            ctx = current_agent()
            final_message = getattr(runner, "_last_message", None)
            message_stream = getattr(final_message, "__self__", None)
            raw_stream = getattr(message_stream, "_raw_stream", None)
            if ctx is None or raw_stream is None:
                return None
            from anthropic.lib._tracing._streaming import streamed_message

            recorder = streamed_message(raw_stream)
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
            return EventRef(event_id, seq, agent_id)
        except Exception:
            _logger.debug("agentcap: could not find a streaming model call", exc_info=True)
            return None

    return find


def _prepare(
    runner: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, is_async: bool
) -> _Call | None:
    """The arguments that run the tool through capture, or None to call the SDK unchanged."""
    try:
        if current_agent() is None:
            return None
        in_kwargs = "tool" in kwargs
        sdk_tool = kwargs["tool"] if in_kwargs else (args[0] if args else None)
        tool_use = kwargs.get("tool_use", args[1] if len(args) > 1 else None)
        tool_use_id = getattr(tool_use, "id", None)
        tool_input = getattr(tool_use, "input", None)
        name = getattr(sdk_tool, "name", None) or getattr(tool_use, "name", None)
        if (
            sdk_tool is None
            or not callable(getattr(sdk_tool, "call", None))
            or not isinstance(tool_use_id, str)
            or not isinstance(name, str)
            or not isinstance(tool_input, Mapping)
        ):
            return None
        captured = _captured_tool(sdk_tool, name, tool_input, is_async=is_async)
        proxy = _CapturedRunnable(sdk_tool, captured, tool_use_id)
        if in_kwargs:
            kwargs = {**kwargs, "tool": proxy}
        else:
            args = (proxy, *args[1:])
        last = getattr(runner, "_last_message", None)
        message = None if callable(last) else last
        pending = _streaming_model_call(runner) if callable(last) else None
        return _Call(
            args, kwargs, tool_use_id, lambda: tool_use_scope(tool_use_id, message, pending)
        )
    except Exception:
        _logger.debug("agentcap: could not capture a tool run of the tool runner", exc_info=True)
        return None


def run_tool_wrapper(*, is_async: bool) -> Wrapper:
    """Wraps a tool runner's ``_run_tool(tool, tool_use)`` (see the module documentation)."""
    if is_async:

        def async_wrapper(
            wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
        ) -> Any:
            call = _prepare(instance, args, kwargs, is_async=True)
            if call is None:
                return wrapped(*args, **kwargs)

            async def run() -> Any:
                with call.scope():
                    result = await wrapped(*call.args, **call.kwargs)
                remember_tool_result(call.tool_use_id)
                return result

            return run()

        return async_wrapper

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        call = _prepare(instance, args, kwargs, is_async=False)
        if call is None:
            return wrapped(*args, **kwargs)
        with call.scope():
            result = wrapped(*call.args, **call.kwargs)
        remember_tool_result(call.tool_use_id)
        return result

    return wrapper
