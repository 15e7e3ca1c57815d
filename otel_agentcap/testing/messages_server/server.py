"""``MessagesServer``: the local Messages API server that tests script and inspect."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

from otel_agentcap.testing.messages_server.handler import HTTPServer
from otel_agentcap.testing.messages_server.replies import Script, SessionResponder, text_reply
from otel_agentcap.testing.messages_server.state import RecordedRequest, ServerState, Session


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
        self._state = ServerState(
            text_reply("Hello from the local Messages API server.")
            if default_reply is None
            else default_reply,
            id_seed,
        )
        self._closed = False
        self._httpd = HTTPServer(
            self._state,
            (host, port),
            sse_framing=sse_framing,
            max_stream_seconds=max_stream_seconds,
        )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"MessagesServer:{self.port}",
            daemon=True,
        )
        self._thread.start()

    @property
    def sse_framing(self) -> Literal["chunked", "close"]:
        return self._httpd.sse_framing

    @property
    def max_stream_seconds(self) -> float:
        return self._httpd.max_stream_seconds

    @property
    def default_reply(self) -> Script:
        """What answers a request when no scripted reply is queued."""
        return self._state.default_reply

    @default_reply.setter
    def default_reply(self, script: Script) -> None:
        self._state.default_reply = script

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
        with self._state.lock:
            self._state.queue.extend(replies)

    @property
    def pending(self) -> int:
        """Number of scripted replies not yet served."""
        with self._state.lock:
            return len(self._state.queue)

    def reset(self) -> None:
        """Forget queued replies and recorded requests."""
        with self._state.lock:
            self._state.queue.clear()
            self._state.requests.clear()

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
        state = self._state
        sid = session_id or state.ids.new("sesn")
        with state.changed:
            if sid in state.sessions:
                raise ValueError(f"session {sid} exists")
            session = Session(sid, on_send)
            session.events.extend(state.stamp_events(events))
            state.sessions[sid] = session
            state.changed.notify_all()
        return sid

    def append_session_events(self, session_id: str, *events: Mapping[str, Any]) -> None:
        """Append ``events`` to a session's log (and to its open streams)."""
        state = self._state
        with state.changed:
            state.sessions[session_id].events.extend(state.stamp_events(events))
            state.changed.notify_all()

    def session_events(self, session_id: str) -> list[dict[str, Any]]:
        """A snapshot of a session's log, the events clients sent included."""
        with self._state.lock:
            return [dict(e) for e in self._state.sessions[session_id].events]

    def drop_session_streams(self, session_id: str) -> None:
        """End every open stream of the session (cleanly), as a server restart would; clients
        reconnect."""
        state = self._state
        with state.changed:
            state.sessions[session_id].generation += 1
            state.changed.notify_all()

    # -- recording

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the requests received so far, in arrival order."""
        with self._state.lock:
            return list(self._state.requests)

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until at least ``count`` requests arrived; TimeoutError after ``timeout`` s."""
        state = self._state
        with state.changed:
            if not state.changed.wait_for(lambda: len(state.requests) >= count, timeout):
                raise TimeoutError(
                    f"{len(state.requests)} of {count} requests arrived within {timeout} s"
                )
            return list(state.requests)

    # -- lifecycle

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, drop open connections and join the server threads (idempotent)."""
        with self._state.lock:
            if self._closed:
                return
            self._closed = True
        self._state.closing.set()
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
