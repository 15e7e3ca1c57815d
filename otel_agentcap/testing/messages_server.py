"""A local HTTP server that speaks the Anthropic Messages API, for offline tests.

`MessagesServer` binds a real `http.server.ThreadingHTTPServer` on 127.0.0.1 and
serves ``POST /v1/messages`` (query strings such as ``?beta=true`` are accepted).
Point the real SDK at it::

    with MessagesServer() as server:
        server.enqueue(text_reply("Hello!", input_tokens=12, output_tokens=3))
        client = anthropic.Anthropic(base_url=server.base_url, api_key="test")
        message = client.messages.create(
            model="claude-sonnet-4-5", max_tokens=64,
            messages=[{"role": "user", "content": "Hi"}],
        )
        assert server.requests[0].body["messages"][0]["content"] == "Hi"

Each request is answered with the next scripted reply from a FIFO queue
(`MessagesServer.enqueue`), or with the default reply when the queue is empty.
A scripted entry is either a reply object (`MessageReply`, `ErrorReply`) or a
callable that receives the parsed JSON request body and returns one, for
multi-turn agents whose replies depend on what they sent (for example to echo
``tool_use`` ids back in ``tool_result`` blocks).

Whether a `MessageReply` is sent as one JSON document or as a server-sent-event
stream depends on the request's ``"stream": true`` field, as with the real API.
The stream options of a reply (``stream_error_after``, ``cut_after``) only
apply to streamed requests; ``delay`` applies to both (once before a JSON
response, before every event of a stream).

Streams use HTTP/1.1 chunked transfer encoding by default, so connections stay
alive between requests as with the real API; a cut-off stream then ends without
the terminating chunk, which clients see as a protocol error. With
``sse_framing="close"`` streams are sent with ``Connection: close`` and end at
EOF, so a cut-off stream looks like a clean end of body.

Sessions (the managed-agents event log, enough to drive the SDK's Sessions tool
runner, ``client.beta.sessions.events.tool_runner``): `MessagesServer.add_session`
creates a session with a scripted history; ``GET /v1/sessions/{id}/events`` lists
it (``limit`` / ``page`` cursor), ``GET /v1/sessions/{id}/events/stream`` streams
the events appended after the stream opened (server-sent events named by their
type; the stream ends after ``session.status_terminated`` / ``session.deleted``, or
on `MessagesServer.drop_session_streams`), and ``POST /v1/sessions/{id}/events``
appends the sent events, then whatever the session's ``on_send`` responder returns
for them (the agent's next events), or refuses them with its `ErrorReply`.

The module depends on the standard library only; it never imports the SDK.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import select
import socket
import string
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType, TracebackType
from typing import Any, Literal, TypeAlias
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "DEFAULT_MODEL",
    "MAX_EVENT_DELAY",
    "ErrorReply",
    "MessageReply",
    "MessagesServer",
    "RecordedRequest",
    "Reply",
    "Responder",
    "Script",
    "SessionResponder",
    "TextContent",
    "ToolCall",
    "error_reply",
    "session_event",
    "text_reply",
    "tool_use_reply",
]

_log = logging.getLogger(__name__)

DEFAULT_MODEL = "claude-sonnet-4-5-20250929"
"""Model reported when neither the reply nor the request names one."""

MAX_EVENT_DELAY = 10.0
"""Upper bound, in seconds, of a reply's ``delay``."""

MAX_DELTAS_PER_BLOCK = 10_000
"""Upper bound of ``text_chunks`` and ``json_chunks``, which bounds a stream's length."""

MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""Bodies larger than this are refused with a 413 ``request_too_large`` error."""

_MESSAGES_PATH = "/v1/messages"
_SESSION_EVENTS_PATH = re.compile(r"^/v1/sessions/([^/]+)/events(/stream)?$")
_SESSION_END_EVENTS = frozenset({"session.status_terminated", "session.deleted"})

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

_ID_ALPHABET = string.ascii_letters + string.digits


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class TextContent:
    """A ``text`` content block of a scripted reply."""

    text: str


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


ContentSpec: TypeAlias = TextContent | ToolCall

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


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request the server received.

    ``path`` includes the query string; ``headers`` has lower-case names;
    ``body`` is the parsed JSON body, or None when it was empty or not JSON.
    ``request_id`` is the ``request-id`` header the server answered with.
    """

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any
    raw_body: bytes
    request_id: str
    received_at: float

    @property
    def route(self) -> str:
        """The path without its query string."""
        return urlsplit(self.path).path

    @property
    def query(self) -> dict[str, list[str]]:
        """The parsed query string."""
        return parse_qs(urlsplit(self.path).query)

    @property
    def stream(self) -> bool:
        """Whether the body asked for a stream."""
        return isinstance(self.body, dict) and self.body.get("stream") is True


# --------------------------------------------------------------------------- helpers


class _IdFactory:
    """``prefix_01...`` ids of 22 random base-62 characters (131 bits: unique in practice, so none
    are remembered, which kept every id of a long-lived server); deterministic when seeded."""

    def __init__(self, seed: int | None) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def new(self, prefix: str) -> str:
        with self._lock:
            tail = "".join(self._rng.choice(_ID_ALPHABET) for _ in range(22))
        return f"{prefix}_01{tail}"


def _split(text: str, pieces: int) -> list[str]:
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


def _estimate_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def _error_body(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else repr(float(seconds))


@dataclass(frozen=True)
class _Resolved:
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
                    for part in _split(spec.text, reply.text_chunks)
                ]
            else:
                encoded = json.dumps(dict(spec.input), ensure_ascii=False)
                delta_bodies = [{"type": "input_json_delta", "partial_json": ""}] + [
                    {"type": "input_json_delta", "partial_json": part}
                    for part in _split(encoded, reply.json_chunks)
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


def _encode_event(name: str, data: Mapping[str, Any]) -> bytes:
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


class _StreamAborted(Exception):
    """The server is closing or the stream exceeded its time budget."""


@dataclass
class _Session:
    """One session's event log; guarded by the server's lock."""

    session_id: str
    on_send: SessionResponder | None
    events: list[dict[str, Any]] = field(default_factory=list)
    #: Bumped by drop_session_streams: open streams of an older generation end.
    generation: int = 0


# --------------------------------------------------------------------------- HTTP


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # close() joins the handler threads itself, with a timeout
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, owner: MessagesServer, address: tuple[str, int]) -> None:
        self.owner = owner
        self._conn_lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        super().__init__(address, _Handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self._conns[request] = threading.current_thread()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conn_lock:
                self._conns.pop(request, None)

    def open_connections(self) -> list[tuple[socket.socket, threading.Thread]]:
        with self._conn_lock:
            return list(self._conns.items())

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("error while serving %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agentcap-messages-server"
    sys_version = ""
    timeout = 60.0  # idle keep-alive connections are dropped after this long
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s - %s", self.address_string(), format % args)

    # -- entry points

    def do_POST(self) -> None:
        self._serve()

    def do_GET(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    # -- request handling

    def _read_body(self) -> bytes | None:
        """The request body, or None if it is too large (the connection is then closed)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_REQUEST_BYTES:
            self.close_connection = True
            return None
        return self.rfile.read(length) if length > 0 else b""

    def _read_chunked(self) -> bytes | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            size_line = self.rfile.readline(1024)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            total += size
            if total > MAX_REQUEST_BYTES:
                self.close_connection = True
                return None
            chunks.append(self.rfile.read(size))
            self.rfile.readline(1024)

    def _serve(self) -> None:
        owner = self.server.owner
        raw = self._read_body()
        received_at = time.time()
        headers = {name.lower(): value for name, value in self.headers.items()}
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None

        route = urlsplit(self.path).path.rstrip("/")
        session_route = _SESSION_EVENTS_PATH.match(route)
        if session_route is not None and raw is not None:
            self._serve_session(session_route, raw, body, headers, received_at)
            return

        reply: Reply
        if raw is None:
            reply = error_reply(413)
        elif route != _MESSAGES_PATH:
            reply = error_reply(404, message=f"Not found: {self.command} {self.path}")
        elif self.command != "POST":
            reply = error_reply(405, "invalid_request_error", f"Method {self.command} not allowed")
        else:
            problem = _validate(raw, body)
            reply = (
                error_reply(400, "invalid_request_error", problem)
                if problem is not None
                else owner._next_reply(body)
            )

        request_id = reply.request_id or owner._ids.new("req")
        owner._record(
            RecordedRequest(
                method=self.command,
                path=self.path,
                headers=MappingProxyType(headers),
                body=body,
                raw_body=raw or b"",
                request_id=request_id,
                received_at=received_at,
            )
        )
        streamed = isinstance(body, dict) and body.get("stream") is True
        try:
            if isinstance(reply, MessageReply) and streamed:
                # a stream's delay is waited before each event instead
                self._send_stream(owner._resolve(reply, body), request_id)
                return
            if reply.delay and owner._closing.wait(reply.delay):
                self.close_connection = True
                return
            if isinstance(reply, ErrorReply):
                self._send_error_reply(reply, request_id)
            else:
                resolved = owner._resolve(reply, body)
                self._send_json(200, resolved.message(complete=True), request_id)
        except (BrokenPipeError, ConnectionResetError, _StreamAborted):
            self.close_connection = True

    # -- sessions

    def _serve_session(
        self,
        route: re.Match[str],
        raw: bytes,
        body: Any,
        headers: dict[str, str],
        received_at: float,
    ) -> None:
        owner = self.server.owner
        session = owner._session(route.group(1))
        stream = route.group(2) is not None
        reply: ErrorReply | None = None
        payload: dict[str, Any] = {}
        if session is None:
            reply = error_reply(404, message=f"session {route.group(1)} not found")
        elif self.command == "GET" and not stream:
            payload = owner._list_session_events(session, self.path)
        elif self.command == "POST" and not stream:
            events = body.get("events") if isinstance(body, dict) else None
            if not isinstance(events, list) or not all(
                isinstance(e, dict) and isinstance(e.get("type"), str) for e in events
            ):
                reply = error_reply(400, message="events: a list of events with a type")
            else:
                sent = owner._send_session_events(session, events)
                if isinstance(sent, ErrorReply):
                    reply = sent
                else:
                    payload = {"data": sent}
        elif self.command != "GET":
            reply = error_reply(405, "invalid_request_error", f"Method {self.command} not allowed")
        request_id = (reply.request_id if reply is not None else None) or owner._ids.new("req")
        owner._record(
            RecordedRequest(
                method=self.command,
                path=self.path,
                headers=MappingProxyType(headers),
                body=body,
                raw_body=raw,
                request_id=request_id,
                received_at=received_at,
            )
        )
        try:
            if reply is not None:
                self._send_error_reply(reply, request_id)
            elif stream and session is not None:
                self._send_session_stream(session, request_id)
            else:
                self._send_json(200, payload, request_id)
        except (BrokenPipeError, ConnectionResetError, _StreamAborted):
            self.close_connection = True

    def _client_gone(self) -> bool:
        """Whether the client closed its end of the connection."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _send_session_stream(self, session: _Session, request_id: str) -> None:
        """Stream the events appended from now on until the session ends, its streams are
        dropped, the server closes, the client leaves or ``max_stream_seconds`` pass."""
        owner = self.server.owner
        deadline = time.monotonic() + owner.max_stream_seconds
        # "From now on" starts before the headers go out: an event appended while the client
        # reads them is streamed, not lost in between.
        with owner._lock:
            start = len(session.events)
            generation = session.generation
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("request-id", request_id)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

        def write(data: bytes) -> None:
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        while time.monotonic() < deadline and not owner._closing.is_set():
            with owner._changed:
                if len(session.events) == start and session.generation == generation:
                    owner._changed.wait(0.05)
                new = session.events[start:]
                start = len(session.events)
                dropped = session.generation != generation
            ended = False
            for event in new:
                write(_encode_event(str(event["type"]), event))
                ended = ended or event["type"] in _SESSION_END_EVENTS
            if ended or dropped:
                break
            if not new and self._client_gone():
                self.close_connection = True
                return
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # -- responses

    def _send_json(
        self,
        status: int,
        payload: Mapping[str, Any],
        request_id: str,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("request-id", request_id)
        for name, value in (extra_headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error_reply(self, reply: ErrorReply, request_id: str) -> None:
        extra: dict[str, str] = {}
        if reply.retry_after is not None:
            extra["retry-after"] = _format_seconds(reply.retry_after)
        if reply.should_retry is not None:
            extra["x-should-retry"] = "true" if reply.should_retry else "false"
        if reply.status == 429:
            extra["anthropic-ratelimit-requests-remaining"] = "0"
        self._send_json(
            reply.status, _error_body(reply.error_type, reply.message), request_id, extra
        )

    def _send_stream(self, resolved: _Resolved, request_id: str) -> None:
        owner = self.server.owner
        reply = resolved.reply
        chunked = owner.sse_framing == "chunked"
        deadline = time.monotonic() + owner.max_stream_seconds

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("request-id", request_id)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

        def write(data: bytes) -> None:
            if reply.delay and owner._closing.wait(reply.delay):
                raise _StreamAborted("server closing")
            if time.monotonic() > deadline:
                raise _StreamAborted("stream exceeded max_stream_seconds")
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data) if chunked else data)
            self.wfile.flush()

        deltas_sent = 0
        for name, data in resolved.events():
            due = name == "message_delta" or (
                name == "content_block_delta"
                and deltas_sent in (reply.stream_error_after, reply.cut_after)
            )
            if due and reply.stream_error_after is not None:
                write(
                    _encode_event(
                        "error",
                        _error_body(reply.stream_error_type, reply.stream_error_message),
                    )
                )
                break
            if due and reply.cut_after is not None:
                self._cut()
                return
            write(_encode_event(name, data))
            if name == "content_block_delta":
                deltas_sent += 1
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _cut(self) -> None:
        """Close the connection in the middle of a response body."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _validate(raw: bytes, body: Any) -> str | None:
    """Why a Messages request body is invalid, or None."""
    if body is None:
        return "There was an issue with the request body: the body must be a JSON object." + (
            "" if raw else " The body is empty."
        )
    if not isinstance(body, dict):
        return "There was an issue with the request body: the body must be a JSON object."
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: Field required"
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        return "max_tokens: Field required"
    if max_tokens < 1:
        return "max_tokens: Input should be greater than or equal to 1"
    if not isinstance(body.get("messages"), list):
        return "messages: Field required"
    return None


# --------------------------------------------------------------------------- server


class MessagesServer:
    """A local Anthropic Messages API server on 127.0.0.1, started on construction.

    Use as a context manager, or call `close()`. ``id_seed`` makes generated ids
    deterministic (for a given order of requests). ``default_reply`` answers
    requests when no scripted reply is queued. ``max_stream_seconds`` bounds the
    duration of any one stream (it is cut off after that). ``sse_framing``
    selects chunked transfer encoding (keep-alive, the default) or
    ``Connection: close`` framing for streams.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_reply: Script | None = None,
        id_seed: int | None = None,
        sse_framing: Literal["chunked", "close"] = "chunked",
        max_stream_seconds: float = 30.0,
    ) -> None:
        if sse_framing not in ("chunked", "close"):
            raise ValueError(f"sse_framing must be 'chunked' or 'close', got {sse_framing!r}")
        if max_stream_seconds <= 0:
            raise ValueError("max_stream_seconds must be > 0")
        self.sse_framing: Literal["chunked", "close"] = sse_framing
        self.max_stream_seconds = max_stream_seconds
        self.default_reply: Script = (
            text_reply("Hello from the local Messages API server.")
            if default_reply is None
            else default_reply
        )
        self._ids = _IdFactory(id_seed)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[Script] = deque()
        self._requests: list[RecordedRequest] = []
        self._sessions: dict[str, _Session] = {}
        self._closing = threading.Event()
        self._closed = False
        self._httpd = _HTTPServer(self, (host, port))
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"MessagesServer:{self.port}",
            daemon=True,
        )
        self._thread.start()

    # -- addresses

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """The URL to pass as ``anthropic.Anthropic(base_url=...)``."""
        return f"http://{self.host}:{self.port}"

    # -- scripting

    def enqueue(self, *replies: Script) -> None:
        """Append scripted replies (or responders) to the FIFO, served one per request."""
        with self._lock:
            self._queue.extend(replies)

    @property
    def pending(self) -> int:
        """Number of scripted replies not yet served."""
        with self._lock:
            return len(self._queue)

    def reset(self) -> None:
        """Forget queued replies and recorded requests."""
        with self._lock:
            self._queue.clear()
            self._requests.clear()

    # -- sessions

    def add_session(
        self,
        events: Sequence[Mapping[str, Any]] = (),
        *,
        session_id: str | None = None,
        on_send: SessionResponder | None = None,
    ) -> str:
        """Create a session whose log starts with ``events`` (see `session_event`); returns its
        id. ``on_send`` answers the events a client sends (see `SessionResponder`)."""
        sid = session_id or self._ids.new("sesn")
        with self._changed:
            if sid in self._sessions:
                raise ValueError(f"session {sid} exists")
            session = _Session(sid, on_send)
            session.events.extend(self._stamp_events(events))
            self._sessions[sid] = session
            self._changed.notify_all()
        return sid

    def append_session_events(self, session_id: str, *events: Mapping[str, Any]) -> None:
        """Append ``events`` to a session's log (and to its open streams)."""
        with self._changed:
            self._sessions[session_id].events.extend(self._stamp_events(events))
            self._changed.notify_all()

    def session_events(self, session_id: str) -> list[dict[str, Any]]:
        """A snapshot of a session's log, the events clients sent included."""
        with self._lock:
            return [dict(e) for e in self._sessions[session_id].events]

    def drop_session_streams(self, session_id: str) -> None:
        """End every open stream of the session (cleanly), as a server restart would; clients
        reconnect."""
        with self._changed:
            self._sessions[session_id].generation += 1
            self._changed.notify_all()

    def _stamp_events(self, events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        return [
            {"id": self._ids.new("sevt"), "processed_at": now, **dict(event)} for event in events
        ]

    def _session(self, session_id: str) -> _Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def _list_session_events(self, session: _Session, path: str) -> dict[str, Any]:
        query = parse_qs(urlsplit(path).query)
        try:
            limit = max(1, min(1000, int(query.get("limit", ["1000"])[0])))
            first = max(0, int(query.get("page", ["0"])[0]))
        except ValueError:
            limit, first = 1000, 0
        with self._lock:
            page = [dict(e) for e in session.events[first : first + limit]]
            more = len(session.events) > first + limit
        return {"data": page, "next_page": str(first + limit) if more else None}

    def _send_session_events(
        self, session: _Session, events: list[dict[str, Any]]
    ) -> list[dict[str, Any]] | ErrorReply:
        sent = self._stamp_events(events)
        follow: Sequence[Mapping[str, Any]] | ErrorReply = ()
        if session.on_send is not None:
            try:
                follow = session.on_send([dict(e) for e in sent])
            except Exception as exc:
                _log.warning("session responder raised", exc_info=True)
                return error_reply(500, "api_error", f"session responder raised {exc!r}")
        if isinstance(follow, ErrorReply):
            return follow
        with self._changed:
            session.events.extend(sent)
            session.events.extend(self._stamp_events(follow))
            self._changed.notify_all()
        return sent

    # -- recording

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the requests received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until at least ``count`` requests arrived; TimeoutError after ``timeout`` s."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._requests) >= count, timeout):
                raise TimeoutError(
                    f"{len(self._requests)} of {count} requests arrived within {timeout} s"
                )
            return list(self._requests)

    # -- lifecycle

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, drop open connections and join the server threads (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._closing.set()
        self._httpd.shutdown()
        connections = self._httpd.open_connections()
        for conn, _ in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for _, thread in connections:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._httpd.server_close()
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> MessagesServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MessagesServer({self.base_url!r}, pending={self.pending})"

    # -- internals used by the handler

    def _record(self, request: RecordedRequest) -> None:
        with self._changed:
            self._requests.append(request)
            self._changed.notify_all()

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            script = self._queue.popleft() if self._queue else self.default_reply
        if isinstance(script, MessageReply | ErrorReply):
            return script
        try:
            reply = script(body)
        except Exception as exc:
            _log.warning("scripted responder raised", exc_info=True)
            return error_reply(500, "api_error", f"scripted responder raised {exc!r}")
        if not isinstance(reply, MessageReply | ErrorReply):
            return error_reply(
                500, "api_error", f"scripted responder returned {type(reply).__name__}"
            )
        return reply

    def _resolve(self, reply: MessageReply, body: dict[str, Any]) -> _Resolved:
        model = reply.model or body.get("model") or DEFAULT_MODEL
        text = "".join(
            spec.text if isinstance(spec, TextContent) else json.dumps(dict(spec.input))
            for spec in reply.content
        )
        return _Resolved(
            reply=reply,
            message_id=reply.message_id or self._ids.new("msg"),
            model=str(model),
            tool_ids=tuple(
                (spec.id or self._ids.new("toolu")) if isinstance(spec, ToolCall) else None
                for spec in reply.content
            ),
            input_tokens=(
                reply.input_tokens
                if reply.input_tokens is not None
                else _estimate_tokens(json.dumps(body.get("messages", [])))
            ),
            output_tokens=(
                reply.output_tokens if reply.output_tokens is not None else _estimate_tokens(text)
            ),
        )
