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

Sessions (the managed-agents event log, enough to drive the SDK's Sessions tool runner,
``client.beta.sessions.events.tool_runner``): `MessagesServer.add_session` creates a session
with a scripted history; ``GET /v1/sessions/{id}`` gives the session and its status (from its
latest status event; ``running`` before any); ``GET /v1/sessions/{id}/events`` lists its log
(``limit`` / ``page`` cursor); ``GET /v1/sessions/{id}/events/stream`` streams the events
appended after the stream opened (server-sent events named by their type; the stream ends after
``session.status_terminated`` / ``session.deleted``, or on
`MessagesServer.drop_session_streams`); and ``POST /v1/sessions/{id}/events`` appends the sent
events, then whatever the session's ``on_send`` responder returns for them (the agent's next
events), or refuses them with its `ErrorReply`.

The package depends on the standard library only; it never imports the SDK. Its modules:
``replies`` (the reply builders and their wire form), ``state`` (what the server holds while it
serves), ``handler`` (the HTTP request handler and server) and ``server`` (:class:`MessagesServer`).
"""

from otel_agentcap.testing.messages_server.handler import MAX_REQUEST_BYTES
from otel_agentcap.testing.messages_server.replies import (
    DEFAULT_MODEL,
    MAX_DELTAS_PER_BLOCK,
    MAX_EVENT_DELAY,
    ErrorReply,
    MessageReply,
    Reply,
    Responder,
    Script,
    SessionResponder,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolCall,
    error_reply,
    session_event,
    text_reply,
    tool_use_reply,
)
from otel_agentcap.testing.messages_server.server import MessagesServer
from otel_agentcap.testing.messages_server.state import RecordedRequest

__all__ = [
    "DEFAULT_MODEL",
    "MAX_DELTAS_PER_BLOCK",
    "MAX_EVENT_DELAY",
    "MAX_REQUEST_BYTES",
    "ErrorReply",
    "MessageReply",
    "MessagesServer",
    "RecordedRequest",
    "Reply",
    "Responder",
    "Script",
    "SessionResponder",
    "StopReason",
    "TextContent",
    "ThinkingContent",
    "ToolCall",
    "error_reply",
    "session_event",
    "text_reply",
    "tool_use_reply",
]
