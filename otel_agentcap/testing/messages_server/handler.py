"""The HTTP side of a :class:`~otel_agentcap.testing.messages_server.MessagesServer`: the request
handler (the Messages API and the sessions event endpoints, JSON and server-sent events) and the
threading HTTP server that runs it and tracks its open connections."""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

from otel_agentcap.testing.messages_server.replies import (
    ErrorReply,
    MessageReply,
    Reply,
    Resolved,
    encode_event,
    error_body,
    error_reply,
)
from otel_agentcap.testing.messages_server.state import (
    SESSION_END_EVENTS,
    RecordedRequest,
    ServerState,
    Session,
)

_log = logging.getLogger("otel_agentcap.testing.messages_server")

MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""Bodies larger than this are refused with a 413 ``request_too_large`` error."""

_MESSAGES_PATH = "/v1/messages"
#: A session (``GET``: the session resource, as ``sessions.retrieve`` reads it) or its events.
_SESSION_EVENTS_PATH = re.compile(r"^/v1/sessions/([^/]+)(/events(/stream)?)?$")


class StreamAborted(Exception):
    """The server is closing or the stream exceeded its time budget."""


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else repr(float(seconds))


class HTTPServer(ThreadingHTTPServer):
    """Serves :class:`RequestHandler` from ``state``, one thread per connection."""

    daemon_threads = True
    block_on_close = False  # close() joins the handler threads itself, with a timeout
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        state: ServerState,
        address: tuple[str, int],
        *,
        sse_framing: Literal["chunked", "close"],
        max_stream_seconds: float,
    ) -> None:
        self.state = state
        self.sse_framing = sse_framing
        self.max_stream_seconds = max_stream_seconds
        self._conn_lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        super().__init__(address, RequestHandler)

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


class RequestHandler(BaseHTTPRequestHandler):
    """One connection: Messages requests answered with the next scripted reply, and the
    sessions event endpoints (list, send, stream)."""

    protocol_version = "HTTP/1.1"
    server_version = "agentcap-messages-server"
    sys_version = ""
    timeout = 60.0  # idle keep-alive connections are dropped after this long
    server: HTTPServer

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
        state = self.server.state
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
                else state.next_reply(body)
            )

        request_id = reply.request_id or state.ids.new("req")
        state.record(
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
                self._send_stream(state.resolve(reply, body), request_id)
                return
            if reply.delay and state.closing.wait(reply.delay):
                self.close_connection = True
                return
            if isinstance(reply, ErrorReply):
                self._send_error_reply(reply, request_id)
            else:
                resolved = state.resolve(reply, body)
                self._send_json(200, resolved.message(complete=True), request_id)
        except (BrokenPipeError, ConnectionResetError, StreamAborted):
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
        state = self.server.state
        session = state.session(route.group(1))
        resource = route.group(2) is None  # /v1/sessions/{id}, not its events
        stream = route.group(3) is not None
        reply: ErrorReply | None = None
        payload: dict[str, Any] = {}
        if session is None:
            reply = error_reply(404, message=f"session {route.group(1)} not found")
        elif resource:
            if self.command == "GET":
                payload = state.session_resource(session)
            else:
                reply = error_reply(
                    405, "invalid_request_error", f"Method {self.command} not allowed"
                )
        elif self.command == "GET" and not stream:
            payload = state.list_session_events(session, self.path)
        elif self.command == "POST" and not stream:
            events = body.get("events") if isinstance(body, dict) else None
            if not isinstance(events, list) or not all(
                isinstance(e, dict) and isinstance(e.get("type"), str) for e in events
            ):
                reply = error_reply(400, message="events: a list of events with a type")
            else:
                sent = state.send_session_events(session, events)
                if isinstance(sent, ErrorReply):
                    reply = sent
                else:
                    payload = {"data": sent}
        elif self.command != "GET":
            reply = error_reply(405, "invalid_request_error", f"Method {self.command} not allowed")
        request_id = (reply.request_id if reply is not None else None) or state.ids.new("req")
        state.record(
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
        except (BrokenPipeError, ConnectionResetError, StreamAborted):
            self.close_connection = True

    def _client_gone(self) -> bool:
        """Whether the client closed its end of the connection."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _send_session_stream(self, session: Session, request_id: str) -> None:
        """Stream the events appended from now on until the session ends, its streams are
        dropped, the server closes, the client leaves or ``max_stream_seconds`` pass."""
        state = self.server.state
        deadline = time.monotonic() + self.server.max_stream_seconds
        # "From now on" starts before the headers go out: an event appended while the client
        # reads them is streamed, not lost in between.
        with state.lock:
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

        while time.monotonic() < deadline and not state.closing.is_set():
            with state.changed:
                if len(session.events) == start and session.generation == generation:
                    state.changed.wait(0.05)
                new = session.events[start:]
                start = len(session.events)
                dropped = session.generation != generation
            ended = False
            for event in new:
                write(encode_event(str(event["type"]), event))
                ended = ended or event["type"] in SESSION_END_EVENTS
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
            reply.status, error_body(reply.error_type, reply.message), request_id, extra
        )

    def _send_stream(self, resolved: Resolved, request_id: str) -> None:
        state = self.server.state
        reply = resolved.reply
        chunked = self.server.sse_framing == "chunked"
        deadline = time.monotonic() + self.server.max_stream_seconds

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
            if reply.delay and state.closing.wait(reply.delay):
                raise StreamAborted("server closing")
            if time.monotonic() > deadline:
                raise StreamAborted("stream exceeded max_stream_seconds")
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
                    encode_event(
                        "error",
                        error_body(reply.stream_error_type, reply.stream_error_message),
                    )
                )
                break
            if due and reply.cut_after is not None:
                self._cut()
                return
            write(encode_event(name, data))
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
