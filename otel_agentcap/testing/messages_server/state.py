"""What a :class:`~otel_agentcap.testing.messages_server.MessagesServer` holds while it serves: the
scripted replies, the recorded requests and the sessions, behind one lock, with the operations its
request handler performs on them."""

from __future__ import annotations

import logging
import random
import string
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from otel_agentcap.testing.messages_server.replies import (
    ErrorReply,
    MessageReply,
    Reply,
    Resolved,
    Script,
    SessionResponder,
    error_reply,
    resolve,
)

_log = logging.getLogger("otel_agentcap.testing.messages_server")

_ID_ALPHABET = string.ascii_letters + string.digits


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


class IdFactory:
    """``prefix_01...`` ids of 22 random base-62 characters (131 bits: unique in practice, so none
    are remembered, which kept every id of a long-lived server); deterministic when seeded."""

    def __init__(self, seed: int | None) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def new(self, prefix: str) -> str:
        with self._lock:
            tail = "".join(self._rng.choice(_ID_ALPHABET) for _ in range(22))
        return f"{prefix}_01{tail}"


#: A session's status after each of the events that change it.
_SESSION_STATUS: Final = {
    "session.status_running": "running",
    "session.status_idle": "idle",
    "session.status_rescheduled": "rescheduling",
    "session.status_terminated": "terminated",
    "session.deleted": "terminated",
}
#: The events after which a session's event stream ends.
SESSION_END_EVENTS: Final = frozenset(
    event for event, status in _SESSION_STATUS.items() if status == "terminated"
)


@dataclass
class Session:
    """One session's event log; guarded by the server's lock."""

    session_id: str
    on_send: SessionResponder | None
    events: list[dict[str, Any]] = field(default_factory=list)
    #: Bumped by drop_session_streams: open streams of an older generation end.
    generation: int = 0


class ServerState:
    """The server's mutable state. Every method is safe to call from any handler thread."""

    def __init__(self, default_reply: Script, id_seed: int | None) -> None:
        self.default_reply = default_reply
        self.ids = IdFactory(id_seed)
        self.lock = threading.Lock()
        #: Notified whenever a request is recorded or a session's log changes.
        self.changed = threading.Condition(self.lock)
        #: Set when the server closes: delays and streams end early.
        self.closing = threading.Event()
        self.queue: deque[Script] = deque()
        self.requests: list[RecordedRequest] = []
        self.sessions: dict[str, Session] = {}

    # -- requests and replies

    def record(self, request: RecordedRequest) -> None:
        with self.changed:
            self.requests.append(request)
            self.changed.notify_all()

    def next_reply(self, body: dict[str, Any]) -> Reply:
        """The next scripted reply (a responder is called with ``body``), else the default one;
        a responder that fails gives a 500 reply."""
        with self.lock:
            script = self.queue.popleft() if self.queue else self.default_reply
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

    def resolve(self, reply: MessageReply, body: dict[str, Any]) -> Resolved:
        return resolve(reply, body, self.ids.new)

    # -- sessions

    def stamp_events(self, events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``events`` with an ``id`` and a ``processed_at`` unless they have them."""
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        return [
            {"id": self.ids.new("sevt"), "processed_at": now, **dict(event)} for event in events
        ]

    def session(self, session_id: str) -> Session | None:
        with self.lock:
            return self.sessions.get(session_id)

    def session_resource(self, session: Session) -> dict[str, Any]:
        """The session as ``GET /v1/sessions/{id}`` returns it: its id and its status, which its
        latest status event gives (``running`` before any)."""
        status = "running"
        with self.lock:
            for event in reversed(session.events):
                found = _SESSION_STATUS.get(str(event.get("type")))
                if found is not None:
                    status = found
                    break
        return {"id": session.session_id, "type": "session", "status": status}

    def list_session_events(self, session: Session, path: str) -> dict[str, Any]:
        """One page of the session's log (``limit`` and ``page`` from the query string)."""
        query = parse_qs(urlsplit(path).query)
        try:
            limit = max(1, min(1000, int(query.get("limit", ["1000"])[0])))
            first = max(0, int(query.get("page", ["0"])[0]))
        except ValueError:
            limit, first = 1000, 0
        with self.lock:
            page = [dict(e) for e in session.events[first : first + limit]]
            more = len(session.events) > first + limit
        return {"data": page, "next_page": str(first + limit) if more else None}

    def send_session_events(
        self, session: Session, events: list[dict[str, Any]]
    ) -> list[dict[str, Any]] | ErrorReply:
        """Append the events a client sent, then its responder's answer; returns the sent
        events as stored, or the responder's error reply (nothing is appended then)."""
        sent = self.stamp_events(events)
        follow: Sequence[Mapping[str, Any]] | ErrorReply = ()
        if session.on_send is not None:
            try:
                follow = session.on_send([dict(e) for e in sent])
            except Exception as exc:
                _log.warning("session responder raised", exc_info=True)
                return error_reply(500, "api_error", f"session responder raised {exc!r}")
        if isinstance(follow, ErrorReply):
            return follow
        with self.changed:
            session.events.extend(sent)
            session.events.extend(self.stamp_events(follow))
            self.changed.notify_all()
        return sent
