"""The replies a :class:`~otel_agentcap.testing.messages_server.MessagesServer` is scripted with,
their builders, and their form on the wire (a JSON message, or the server-sent events of a
stream, in the real API's order)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

DEFAULT_MODEL = "claude-sonnet-4-5-20250929"
"""Model reported when neither the reply nor the request names one."""

MAX_EVENT_DELAY = 10.0
"""Upper bound, in seconds, of a reply's ``delay``."""

MAX_DELTAS_PER_BLOCK = 10_000
"""Upper bound of ``text_chunks`` and ``json_chunks``, which bounds a stream's length."""

_DEFAULT_ERROR_TYPES: Mapping[int, tuple[str, str]] = MappingProxyType(
    {
        400: ("invalid_request_error", "Invalid request."),
        401: ("authentication_error", "invalid x-api-key"),
        403: ("permission_error", "Your API key does not have permission to use this resource."),
        404: ("not_found_error", "Not found."),
        413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
        429: ("rate_limit_error", "Number of requests has exceeded your rate limit."),
        500: ("api_error", "Internal server error."),
        529: ("overloaded_error", "Overloaded"),
    }
)


@dataclass(frozen=True)
class TextContent:
    """A ``text`` content block of a scripted reply."""

    text: str


@dataclass(frozen=True)
class ThinkingContent:
    """A ``thinking`` content block of a scripted reply (extended thinking): streamed as
    ``thinking_delta`` events (split like a text block) then one ``signature_delta``."""

    thinking: str
    signature: str = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"


@dataclass(frozen=True)
class ToolCall:
    """A ``tool_use`` content block of a scripted reply.

    ``id`` fixes the block's ``toolu_...`` id; when None the server generates a
    fresh unique one each time the reply is served. ``toolset_name`` makes the
    block a toolset member call (``"browser"``, ``"computer"``).
    """

    name: str
    input: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    id: str | None = None
    toolset_name: str | None = None


ContentSpec: TypeAlias = TextContent | ThinkingContent | ToolCall

StopReason: TypeAlias = Literal[
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
]


@dataclass(frozen=True)
class MessageReply:
    """A successful Messages API reply, served as JSON or as an SSE stream.

    Token counts left as None are estimated (about four characters a token) so
    that usage is always present and positive. ``model`` None echoes the
    request's model. ``message_id`` / ``request_id`` None generate fresh ids.

    Stream-only options:
      * ``text_chunks``: number of ``text_delta`` events a text block is split into
        (fewer if the text is shorter).
      * ``json_chunks``: number of non-empty ``input_json_delta`` events a tool
        input is split into (after the empty first one the real API sends).
      * ``ping_every``: send a ``ping`` event after every that many deltas, in
        addition to the one after the first ``content_block_start``; None for no
        extra pings.
      * ``stream_error_after``: after that many ``content_block_delta`` events,
        send an ``event: error`` with an ``overloaded_error`` body (see
        ``stream_error_type``) and end the stream.
      * ``cut_after``: after that many ``content_block_delta`` events, close the
        connection without sending the remaining events.
      If either number is at least the number of deltas, the error or cut
      happens just before ``message_delta``.

    ``delay`` is waited before a JSON response, and before every event of a
    stream (so a stream takes about ``delay * events`` seconds).
    """

    content: tuple[ContentSpec, ...]
    stop_reason: StopReason = "end_turn"
    stop_sequence: str | None = None
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read: int = 0
    cache_creation: int = 0
    message_id: str | None = None
    request_id: str | None = None
    text_chunks: int = 20
    json_chunks: int = 4
    ping_every: int | None = 5
    stream_error_after: int | None = None
    stream_error_type: str = "overloaded_error"
    stream_error_message: str = "Overloaded"
    cut_after: int | None = None
    delay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "cache_read", "cache_creation"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name in ("text_chunks", "json_chunks"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_DELTAS_PER_BLOCK:
                raise ValueError(f"{name} must be in [1, {MAX_DELTAS_PER_BLOCK}], got {value}")
        if self.ping_every is not None and self.ping_every < 1:
            raise ValueError(f"ping_every must be >= 1 or None, got {self.ping_every}")
        for name in ("stream_error_after", "cut_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if self.stream_error_after is not None and self.cut_after is not None:
            raise ValueError("stream_error_after and cut_after are mutually exclusive")
        _check_delay(self.delay)


@dataclass(frozen=True)
class ErrorReply:
    """An HTTP error reply with the real API's error body and headers.

    ``retry_after`` (seconds, may be fractional) sets the ``retry-after`` header;
    ``should_retry`` sets ``x-should-retry``. Error replies are always JSON,
    even for streamed requests, as the real API refuses a request before any
    stream starts.
    """

    status: int
    error_type: str
    message: str
    retry_after: float | None = None
    should_retry: bool | None = None
    request_id: str | None = None
    delay: float = 0.0

    def __post_init__(self) -> None:
        if not 400 <= self.status <= 599:
            raise ValueError(f"status must be a 4xx or 5xx code, got {self.status}")
        if self.retry_after is not None and self.retry_after < 0:
            raise ValueError(f"retry_after must be >= 0, got {self.retry_after}")
        _check_delay(self.delay)


Reply: TypeAlias = MessageReply | ErrorReply
Responder: TypeAlias = Callable[[dict[str, Any]], Reply]
"""A function of the parsed JSON request body returning the reply to serve."""
Script: TypeAlias = Reply | Responder
SessionResponder: TypeAlias = Callable[
    [list[dict[str, Any]]], Sequence[Mapping[str, Any]] | ErrorReply
]
"""A function of the events a client sent to a session (with their ids) returning the events
the session appends after them, or an `ErrorReply` that refuses them."""


def _check_delay(delay: float) -> None:
    if not 0.0 <= delay <= MAX_EVENT_DELAY:
        raise ValueError(f"delay must be in [0, {MAX_EVENT_DELAY}] seconds, got {delay}")


def text_reply(
    text: str,
    *,
    model: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    cache_read: int = 0,
    cache_creation: int = 0,
    stop_reason: StopReason = "end_turn",
    stop_sequence: str | None = None,
    message_id: str | None = None,
    request_id: str | None = None,
    text_chunks: int = 20,
    ping_every: int | None = 5,
    stream_error_after: int | None = None,
    cut_after: int | None = None,
    delay: float = 0.0,
) -> MessageReply:
    """A reply with a single ``text`` block."""
    return MessageReply(
        content=(TextContent(text),),
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        model=model,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cache_read=cache_read,
        cache_creation=cache_creation,
        message_id=message_id,
        request_id=request_id,
        text_chunks=text_chunks,
        ping_every=ping_every,
        stream_error_after=stream_error_after,
        cut_after=cut_after,
        delay=delay,
    )


def tool_use_reply(
    tool_calls: Sequence[ToolCall | tuple[str, Mapping[str, Any]]],
    text: str | None = None,
    *,
    model: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    cache_read: int = 0,
    cache_creation: int = 0,
    stop_reason: StopReason = "tool_use",
    message_id: str | None = None,
    request_id: str | None = None,
    text_chunks: int = 20,
    json_chunks: int = 4,
    ping_every: int | None = 5,
    stream_error_after: int | None = None,
    cut_after: int | None = None,
    delay: float = 0.0,
) -> MessageReply:
    """A reply with an optional leading ``text`` block then one ``tool_use`` block per call.

    Calls are ``(name, input)`` pairs, or `ToolCall` objects to fix the tool_use id.
    """
    if not tool_calls:
        raise ValueError("tool_use_reply needs at least one tool call")
    blocks: list[ContentSpec] = [] if text is None else [TextContent(text)]
    for call in tool_calls:
        if isinstance(call, ToolCall):
            blocks.append(call)
        else:
            name, tool_input = call
            blocks.append(ToolCall(name=name, input=MappingProxyType(dict(tool_input))))
    return MessageReply(
        content=tuple(blocks),
        stop_reason=stop_reason,
        model=model,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cache_read=cache_read,
        cache_creation=cache_creation,
        message_id=message_id,
        request_id=request_id,
        text_chunks=text_chunks,
        json_chunks=json_chunks,
        ping_every=ping_every,
        stream_error_after=stream_error_after,
        cut_after=cut_after,
        delay=delay,
    )


def error_reply(
    status: int,
    error_type: str | None = None,
    message: str | None = None,
    retry_after: float | None = None,
    *,
    should_retry: bool | None = None,
    request_id: str | None = None,
    delay: float = 0.0,
) -> ErrorReply:
    """An HTTP error; ``error_type`` and ``message`` default to the real API's for the status.

    400 invalid_request_error, 401 authentication_error, 403 permission_error,
    404 not_found_error, 413 request_too_large, 429 rate_limit_error,
    500 api_error, 529 overloaded_error; other statuses default to api_error.
    """
    default_type, default_message = _DEFAULT_ERROR_TYPES.get(status, ("api_error", "Error."))
    return ErrorReply(
        status=status,
        error_type=default_type if error_type is None else error_type,
        message=default_message if message is None else message,
        retry_after=retry_after,
        should_retry=should_retry,
        request_id=request_id,
        delay=delay,
    )


def session_event(event_type: str, /, **fields: Any) -> dict[str, Any]:
    """A session event of ``event_type`` with ``fields``; the server gives it an ``id``
    (``sevt_...``) and a ``processed_at`` when it is added, unless ``fields`` has them."""
    return {"type": event_type, **fields}


def split_text(text: str, pieces: int) -> list[str]:
    """Split ``text`` into at most ``pieces`` non-empty consecutive parts."""
    if not text:
        return []
    pieces = min(pieces, len(text))
    size, extra = divmod(len(text), pieces)
    parts: list[str] = []
    start = 0
    for index in range(pieces):
        end = start + size + (1 if index < extra else 0)
        parts.append(text[start:end])
        start = end
    return parts


def estimate_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def error_body(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


@dataclass(frozen=True)
class Resolved:
    """A `MessageReply` with every id, model and token count fixed for one response."""

    reply: MessageReply
    message_id: str
    model: str
    tool_ids: tuple[str | None, ...]
    input_tokens: int
    output_tokens: int

    def usage(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.reply.cache_creation,
            "cache_read_input_tokens": self.reply.cache_read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.reply.cache_creation,
                "ephemeral_1h_input_tokens": 0,
            },
            "output_tokens": output_tokens,
            "service_tier": "standard",
        }

    def block(self, index: int, *, complete: bool) -> dict[str, Any]:
        spec = self.reply.content[index]
        if isinstance(spec, TextContent):
            return {"type": "text", "text": spec.text if complete else ""}
        if isinstance(spec, ThinkingContent):
            return {
                "type": "thinking",
                "thinking": spec.thinking if complete else "",
                "signature": spec.signature if complete else "",
            }
        block = {
            "type": "tool_use",
            "id": self.tool_ids[index],
            "name": spec.name,
            "input": dict(spec.input) if complete else {},
        }
        if spec.toolset_name is not None:
            block["toolset_name"] = spec.toolset_name
        return block

    def message(self, *, complete: bool) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": (
                [self.block(i, complete=True) for i in range(len(self.reply.content))]
                if complete
                else []
            ),
            "stop_reason": self.reply.stop_reason if complete else None,
            "stop_sequence": self.reply.stop_sequence if complete else None,
            "usage": self.usage(self.output_tokens if complete else 1),
        }

    def events(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The SSE events of the stream, in the real API's order."""
        reply = self.reply
        yield "message_start", {"type": "message_start", "message": self.message(complete=False)}
        deltas = 0
        for index, spec in enumerate(reply.content):
            yield (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": self.block(index, complete=False),
                },
            )
            if index == 0:
                yield "ping", {"type": "ping"}
            if isinstance(spec, TextContent):
                delta_bodies = [
                    {"type": "text_delta", "text": part}
                    for part in split_text(spec.text, reply.text_chunks)
                ]
            elif isinstance(spec, ThinkingContent):
                delta_bodies = [
                    {"type": "thinking_delta", "thinking": part}
                    for part in split_text(spec.thinking, reply.text_chunks)
                ] + [{"type": "signature_delta", "signature": spec.signature}]
            else:
                encoded = json.dumps(dict(spec.input), ensure_ascii=False)
                delta_bodies = [{"type": "input_json_delta", "partial_json": ""}] + [
                    {"type": "input_json_delta", "partial_json": part}
                    for part in split_text(encoded, reply.json_chunks)
                ]
            for delta in delta_bodies:
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": delta,
                    },
                )
                deltas += 1
                if reply.ping_every is not None and deltas % reply.ping_every == 0:
                    yield "ping", {"type": "ping"}
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reply.stop_reason, "stop_sequence": reply.stop_sequence},
                "usage": {"output_tokens": self.output_tokens},
            },
        )
        yield "message_stop", {"type": "message_stop"}


def encode_event(name: str, data: Mapping[str, Any]) -> bytes:
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


def resolve(reply: MessageReply, body: dict[str, Any], new_id: Callable[[str], str]) -> Resolved:
    """``reply`` with its ids (``new_id(prefix)`` for those it leaves open), model and token
    counts fixed for one response to the request ``body``."""
    model = reply.model or body.get("model") or DEFAULT_MODEL
    text = "".join(
        spec.text
        if isinstance(spec, TextContent)
        else spec.thinking
        if isinstance(spec, ThinkingContent)
        else json.dumps(dict(spec.input))
        for spec in reply.content
    )
    return Resolved(
        reply=reply,
        message_id=reply.message_id or new_id("msg"),
        model=str(model),
        tool_ids=tuple(
            (spec.id or new_id("toolu")) if isinstance(spec, ToolCall) else None
            for spec in reply.content
        ),
        input_tokens=(
            reply.input_tokens
            if reply.input_tokens is not None
            else estimate_tokens(json.dumps(body.get("messages", [])))
        ),
        output_tokens=(
            reply.output_tokens if reply.output_tokens is not None else estimate_tokens(text)
        ),
    )
