"""Run the ``tool_use`` blocks of a Messages API response through captured tools.

:func:`run_tool_uses` (and :func:`arun_tool_uses` for async code) gives the causal chain
model call -> tool -> next model call:

* each tool runs as ``Tool.invoke(tool_use_id, **input)``, so the invocation id is the tool_use
  id (a retry of the same block returns the recorded outcome), with the ``model_call`` event that
  asked for it as causal parent (found by the response id, also when that call was made by
  another agent of the run);
* each tool's result event (or its error event) is remembered under the tool_use id, and the
  request wrapper of :class:`~otel_agentcap.instrumentation.anthropic.AnthropicInstrumentor`
  names it as causal parent of the next model call whose ``messages=`` carries that
  ``tool_result`` block.

A tool that raises becomes an ``is_error`` tool_result block (the error is recorded as usual); a
tool_use for a tool not in ``tools`` too. Needs only ``opentelemetry-api``.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from otel_agentcap import jsonsafe
from otel_agentcap.capture.tools import Tool, invocations
from otel_agentcap.context import caused_by, current_agent
from otel_agentcap.model import EventRef, validate_id
from otel_agentcap.pipeline import causal_links

__all__ = [
    "arun_tool_uses",
    "remember_tool_result",
    "run_tool_uses",
    "tool_use_blocks",
    "tool_use_scope",
]

_logger = logging.getLogger(__name__)

ToolSet = Mapping[str, Tool[..., Any]] | Iterable[Tool[..., Any]]


_sdk_exactly_once = False


def set_sdk_tools_exactly_once(enabled: bool) -> None:
    """Whether the anthropic SDK's tool runners and toolsets run each tool_use exactly once by
    default (see ``otel_agentcap.instrumentation.anthropic.exactly_once``); off by default, so
    capture records every execution the SDK makes, as it makes it. Kept here, away from the
    instrumentation package, so ``configure()`` can set it without importing the SDK's
    instrumentation dependencies."""
    global _sdk_exactly_once
    _sdk_exactly_once = bool(enabled)


def sdk_tools_exactly_once() -> bool:
    return _sdk_exactly_once


def _get(value: Any, key: str) -> Any:
    if isinstance(value, Mapping):
        return value.get(key)
    return getattr(value, key, None)


def tool_use_blocks(message: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """``(id, name, input)`` of each ``tool_use`` block of ``message`` (a Message or its dict)."""
    blocks: list[tuple[str, str, dict[str, Any]]] = []
    for block in _get(message, "content") or ():
        if _get(block, "type") != "tool_use":
            continue
        tool_input = _get(block, "input")
        block_id = _get(block, "id")
        blocks.append(
            (
                block_id if isinstance(block_id, str) else "",
                str(_get(block, "name")),
                dict(tool_input) if isinstance(tool_input, Mapping) else {},
            )
        )
    return blocks


def _tools_by_name(tools: ToolSet) -> dict[str, Tool[..., Any]]:
    if isinstance(tools, Mapping):
        return dict(tools)
    return {t.name: t for t in tools}


def _content(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(jsonsafe.to_jsonable(result), ensure_ascii=False)
    except Exception:
        return repr(result)


def _invoke(tool: Tool[..., Any], tool_use_id: str, tool_input: dict[str, Any]) -> Any:
    """Run ``tool`` for a tool_use block: as invocation ``tool_use_id``, or, for an id that cannot
    be one (missing, or with characters or a length ids may not have), as a plain captured call
    without retry protection, rather than not at all."""
    try:
        invocation_id = validate_id(tool_use_id, "tool_use id")
    except (TypeError, ValueError) as exc:
        _logger.warning("agentcap: running %s without an invocation id: %s", tool.name, exc)
        return tool(**tool_input)
    return tool.invoke(invocation_id, **tool_input)


def _error_block(tool_use_id: str, message: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": message, "is_error": True}


def _ok_block(tool_use_id: str, result: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": _content(result)}


def tool_use_scope(
    tool_use_id: str,
    message: Any = None,
    pending: Callable[[], EventRef | None] | None = None,
) -> AbstractContextManager[None]:
    """``caused_by(<the model call that asked for tool_use_id>)`` when it is known, else a no-op.

    The model call is found by the response id of ``message`` (when given), then by the tool_use
    id, then by ``pending`` (for a call whose response is still streaming, so not yet indexed).
    Never raises."""
    try:
        ctx = current_agent()
        if ctx is None:
            return nullcontext()
        ref = None
        response_id = _get(message, "id") if message is not None else None
        if isinstance(response_id, str):
            ref = causal_links.model_call_for_response(ctx.run_id, response_id)
        if ref is None:
            ref = causal_links.model_call_for_tool_use(ctx.run_id, tool_use_id)
        if ref is None and pending is not None:
            ref = pending()
        return caused_by(ref) if ref is not None else nullcontext()
    except Exception:
        _logger.debug("agentcap: could not find the model call of %s", tool_use_id, exc_info=True)
        return nullcontext()


def remember_tool_result(tool_use_id: str) -> None:
    """Index the result (or error) event of the current agent's invocation ``tool_use_id`` in
    :mod:`otel_agentcap.pipeline.causal_links`, so the request carrying its tool_result names
    it. Never raises."""
    try:
        ctx = current_agent()
        if ctx is None:
            return
        entry = invocations.lookup((ctx.run_id, ctx.agent_id, tool_use_id))
        if entry is not None and entry.result_event is not None:
            causal_links.record_tool_result(ctx.run_id, tool_use_id, entry.result_event)
    except Exception:
        _logger.debug("agentcap: could not index the result of %s", tool_use_id, exc_info=True)


def run_tool_uses(message: Any, tools: ToolSet) -> list[dict[str, Any]]:
    """Run every ``tool_use`` block of ``message`` with the matching tool of ``tools`` (a list of
    :class:`~otel_agentcap.Tool` or a name -> Tool mapping) and return the ``tool_result`` blocks
    to send back, in order. Async tools are refused here: use :func:`arun_tool_uses`."""
    by_name = _tools_by_name(tools)
    results: list[dict[str, Any]] = []
    for tool_use_id, name, tool_input in tool_use_blocks(message):
        tool = by_name.get(name)
        if tool is None:
            results.append(_error_block(tool_use_id, f"unknown tool: {name}"))
            continue
        if tool.is_async:
            raise TypeError(f"tool {name!r} is async; use arun_tool_uses")
        try:
            with tool_use_scope(tool_use_id, message):
                result = _invoke(tool, tool_use_id, tool_input)
        except Exception as error:
            results.append(_error_block(tool_use_id, f"{type(error).__name__}: {error}"))
        else:
            results.append(_ok_block(tool_use_id, result))
        remember_tool_result(tool_use_id)
    return results


async def arun_tool_uses(message: Any, tools: ToolSet) -> list[dict[str, Any]]:
    """:func:`run_tool_uses` for async code: async tools are awaited, sync ones called, in order."""
    by_name = _tools_by_name(tools)
    results: list[dict[str, Any]] = []
    for tool_use_id, name, tool_input in tool_use_blocks(message):
        tool = by_name.get(name)
        if tool is None:
            results.append(_error_block(tool_use_id, f"unknown tool: {name}"))
            continue
        try:
            with tool_use_scope(tool_use_id, message):
                outcome = _invoke(tool, tool_use_id, tool_input)
                result = await outcome if inspect.isawaitable(outcome) else outcome
        except Exception as error:
            results.append(_error_block(tool_use_id, f"{type(error).__name__}: {error}"))
        else:
            results.append(_ok_block(tool_use_id, result))
        remember_tool_result(tool_use_id)
    return results
