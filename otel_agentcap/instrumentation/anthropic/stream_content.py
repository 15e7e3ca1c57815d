"""With content on, the output of a raw ``messages.create(stream=True)`` that completed, on an SDK
that traces itself, in an attribute of agentcap's own.

The SDK records a stream's output content (``gen_ai.output.messages``) only when its stream helper
(``messages.stream()``) shares the Message it builds. A stream read without the helper gets no
output content on the SDK's span, on purpose (its own tests assert it), and neither does a raw
stream that ends early or is closed. Instrumenting the SDK never changes its telemetry, so the
SDK's attributes stay as the SDK sets them, and agentcap records the output of such a stream in
:data:`~otel_agentcap.pipeline.model_calls.OUTPUT_MESSAGES` (``agentcap.model_call.output_messages``)
on the same span, from which the ``model_call`` event's payload takes it
(``content.output_messages``).

Only a completed stream gets it: read to the end of its body, after ``message_stop``, with no
error (the span's status is OK); not one closed, dropped, failed or cut off, even after
``message_stop``. The value has the shape of the SDK's ``gen_ai.output.messages`` for the same
Message read with the helper (the GenAI conventions' output messages: one assistant message and
its parts; the stop reason is the payload's ``stop_reason``), so the payload's
``content.output_messages`` reads the same for both; it is built by :mod:`.stream_blocks` from the
events and bounded by the client's ``max_content_bytes``.

Beware: private parts of the SDK, reached on purpose: the stream recorder
``anthropic.lib._tracing._streaming.StreamedMessage`` (its ``item(event)``, where every event of a
stream passes, and ``end(how, error)``, called before the span ends) and its ``_content`` (the
client's content mode), ``_shared_snapshot`` (set by a helper), ``_span`` and
``_max_content_bytes``, read with getattr. Nothing public reaches a stream's span before it ends.
Tested at anthropic 2.14 and 2.15. Missing, the hook records nothing (one warning) and the SDK
records what it records on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from otel_agentcap import jsonsafe, private_parts
from otel_agentcap.instrumentation.anthropic.stream_blocks import StreamedBlocks
from otel_agentcap.pipeline.model_calls import OUTPUT_MESSAGES

_logger = logging.getLogger(__name__)

_STATE = "_agentcap_stream_output"
#: The SDK's default ``max_content_bytes``, for a recorder that does not say.
_DEFAULT_LIMIT = 750_000

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


def _missing(part: str) -> None:
    private_parts.missing(
        "anthropic",
        f"StreamedMessage.{part}",
        "a raw messages.create(stream=True) read to the end records no output with content on",
    )


def _start(recorder: Any) -> None:
    """At ``message_start``: follow this stream when its output is ours to record."""
    if not hasattr(recorder, "_content"):
        _missing("_content")
        return
    if not getattr(recorder, "_content", False):
        return
    # A helper shares its Message before the first event; the SDK then records the output itself.
    if getattr(recorder, "_shared_snapshot", None) is not None:
        return
    setattr(recorder, _STATE, StreamedBlocks())


def item_hook() -> Wrapper:
    """Wraps ``StreamedMessage.item(event)``: reads every event of a stream being followed."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            event = args[0] if args else kwargs.get("event")
            state: StreamedBlocks | None = getattr(instance, _STATE, None)
            if state is None:
                if getattr(event, "type", None) == "message_start":
                    _start(instance)
                    state = getattr(instance, _STATE, None)
                if state is None:
                    return result
            state.add(event)
        except Exception:
            _logger.debug("agentcap: could not observe a stream event", exc_info=True)
        return result

    return wrapper


def end_hook() -> Wrapper:
    """Wraps ``StreamedMessage.end(how, error=None)``: before the SDK ends the span, records the
    output of a stream that completed."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        try:
            how = args[0] if args else kwargs.get("how")
            error = args[1] if len(args) > 1 else kwargs.get("error")
            _record(instance, how, error)
        except Exception:
            _logger.debug("agentcap: could not record a stream's output", exc_info=True)
        return wrapped(*args, **kwargs)

    return wrapper


def _record(recorder: Any, how: Any, error: Any) -> None:
    state: StreamedBlocks | None = getattr(recorder, _STATE, None)
    if state is None:
        return
    delattr(recorder, _STATE)
    if how != "read" or error is not None or not state.complete:
        return
    blocks = state.blocks()
    span = getattr(recorder, "_span", None)
    if span is None:
        _missing("_span")
        return
    if blocks is None or not span.is_recording():
        return
    limit = getattr(recorder, "_max_content_bytes", None)
    if not isinstance(limit, int) or limit < 1:
        limit = _DEFAULT_LIMIT
    messages = [{"role": "assistant", "parts": parts(blocks)}]
    span.set_attribute(OUTPUT_MESSAGES, bounded(jsonsafe.dumps(messages, max_chars=limit), limit))


def bounded(text: str, limit: int) -> str:
    """``text`` when it is at most ``limit`` bytes of UTF-8, else its ``$agentcap.truncated``
    marker within that size (as far as a marker can be)."""
    if len(text) <= limit and (
        text.isascii() or len(text.encode("utf-8", "surrogatepass")) <= limit
    ):
        return text
    chars = min(len(text), limit)
    while True:
        marker = jsonsafe.truncate(text, chars)
        if chars == 0 or len(marker.encode("utf-8", "surrogatepass")) <= limit:
            return marker
        chars //= 2


# ------------------------------------------------- content blocks as GenAI output message parts


def parts(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GenAI conventions' message parts of Anthropic content blocks, as the SDK writes them in
    ``gen_ai.output.messages``: text, reasoning (thinking), tool_call (tool_use, server_tool_use,
    mcp_tool_use, with the input as arguments), tool_call_response (``*_tool_result`` blocks,
    without encrypted fields or image and document data); any other block keeps only its type,
    as ``anthropic_<type>``."""
    return [_part(block) for block in blocks]


def _part(block: Mapping[str, Any]) -> dict[str, Any]:
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "content": block.get("text")}
    if kind == "thinking":
        return {"type": "reasoning", "content": block.get("thinking")}
    if kind in ("tool_use", "server_tool_use", "mcp_tool_use"):
        part = {
            "type": "tool_call",
            "id": block.get("id"),
            "name": block.get("name"),
            "arguments": block.get("input"),
        }
        if kind == "mcp_tool_use":
            part["anthropic_mcp_server_name"] = block.get("server_name")
        elif kind == "tool_use" and isinstance(block.get("toolset_name"), str):
            part["anthropic_toolset_name"] = block["toolset_name"]
        return part
    if isinstance(kind, str) and kind.endswith("_tool_result"):
        return {
            "type": "tool_call_response",
            "id": block.get("tool_use_id"),
            "response": _without_opaque(block.get("content")),
        }
    return {"type": f"anthropic_{kind}" if isinstance(kind, str) else "anthropic_unknown"}


def _without_opaque(value: Any) -> Any:
    """``value`` without ``encrypted_*`` fields (opaque) and image or document data (large and
    binary), at any depth."""
    if isinstance(value, list | tuple):
        return [_without_opaque(item) for item in value]
    if not isinstance(value, Mapping):
        return value
    if value.get("type") in ("image", "document"):
        return {"type": value["type"]}
    return {
        key: _without_opaque(item)
        for key, item in value.items()
        if not (isinstance(key, str) and key.startswith("encrypted_"))
    }
