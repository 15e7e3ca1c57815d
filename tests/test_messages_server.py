"""The local Messages API server, exercised with the real anthropic SDK (no network)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import pytest

try:
    import httpx2 as httpx  # the HTTP client of anthropic 2.x
except ImportError:  # older releases use httpx (.ci/floors runs the suite at the floor, 0.40)
    import httpx
from anthropic_support import MODEL, USER, needs_anthropic

from otel_agentcap.testing.messages_server import (
    ErrorReply,
    MessageReply,
    MessagesServer,
    TextContent,
    ThinkingContent,
    ToolCall,
    error_reply,
    session_event,
    text_reply,
    tool_use_reply,
)

pytestmark = pytest.mark.timeout(30)

# The SDK's class for a 529 (releases before it raise InternalServerError, as for any 5xx).
OVERLOADED = getattr(anthropic, "OverloadedError", anthropic.InternalServerError)


@pytest.fixture
def client(server: MessagesServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="test", max_retries=0) as cli:
        yield cli


def _create(client: anthropic.Anthropic, **extra: Any) -> anthropic.types.Message:
    return client.messages.create(model=MODEL, max_tokens=64, messages=USER, **extra)


def _raw_post(
    server: MessagesServer, body: Any, path: str = "/v1/messages"
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events


# --------------------------------------------------------------------------- JSON replies


def test_json_text_reply_parses_with_scripted_usage_and_ids(server, client):
    """A scripted text reply parses into an SDK Message with its usage, ids and stop reason."""
    server.enqueue(
        text_reply(
            "Hi there",
            input_tokens=120,
            output_tokens=7,
            cache_read=100,
            cache_creation=20,
            message_id="msg_fixed",
            request_id="req_fixed",
            model="claude-test-model",
        )
    )
    message = _create(client)
    assert isinstance(message, anthropic.types.Message)
    assert message.id == "msg_fixed"
    assert message._request_id == "req_fixed"
    assert message.model == "claude-test-model"
    assert message.role == "assistant"
    assert message.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", "Hi there")]
    usage = message.usage
    assert (usage.input_tokens, usage.output_tokens) == (120, 7)
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (100, 20)


def test_json_tool_use_reply_parses_into_tool_use_blocks(server, client):
    """A tool_use reply yields a text block then ToolUseBlocks with toolu_ ids and inputs."""
    server.enqueue(
        tool_use_reply(
            [("get_weather", {"city": "Paris"}), ToolCall("get_time", {"tz": "UTC"}, id="toolu_x")],
            text="Checking.",
            output_tokens=30,
        )
    )
    message = _create(client)
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens == 30
    text, weather, clock = message.content
    assert isinstance(text, anthropic.types.TextBlock) and text.text == "Checking."
    assert isinstance(weather, anthropic.types.ToolUseBlock)
    assert weather.id.startswith("toolu_") and weather.name == "get_weather"
    assert weather.input == {"city": "Paris"}
    assert isinstance(clock, anthropic.types.ToolUseBlock)
    assert (clock.id, clock.name, clock.input) == ("toolu_x", "get_time", {"tz": "UTC"})


def test_default_reply_served_when_queue_empty(server, client):
    """With nothing queued the server answers with its default short text message."""
    server.enqueue(text_reply("scripted"))
    assert server.pending == 1
    assert _create(client).content[0].text == "scripted"  # type: ignore[union-attr]
    default = _create(client)
    assert default.content[0].text == "Hello from the local Messages API server."  # type: ignore[union-attr]
    assert default.id.startswith("msg_") and default._request_id.startswith("req_")  # type: ignore[union-attr]
    assert server.pending == 0


def test_max_tokens_stop_reason(server, client):
    """A reply scripted with stop_reason max_tokens reports it."""
    server.enqueue(text_reply("truncated", stop_reason="max_tokens"))
    assert _create(client).stop_reason == "max_tokens"


def test_seeded_ids_are_deterministic_and_unique():
    """Two servers with the same id_seed generate the same ids, all distinct."""
    ids = []
    for _ in range(2):
        with (
            MessagesServer(id_seed=7) as srv,
            anthropic.Anthropic(base_url=srv.base_url, api_key="test") as cli,
        ):
            srv.enqueue(tool_use_reply([("a", {}), ("b", {})]))
            messages = [_create(cli) for _ in range(3)]
            ids.append(
                [m.id for m in messages]
                + [b.id for b in messages[0].content if isinstance(b, anthropic.types.ToolUseBlock)]
            )
    assert ids[0] == ids[1]
    assert len(set(ids[0])) == 5


# --------------------------------------------------------------------------- streams


def test_create_stream_true_yields_real_event_sequence(server, client):
    """messages.create(stream=True) yields the real event order and the scripted final usage."""
    server.enqueue(text_reply("abcdefghijklmnopqrstuvwxyz", input_tokens=11, output_tokens=9))
    with _create(client, stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types == (
        ["message_start", "content_block_start"]
        + ["content_block_delta"] * 20
        + ["content_block_stop", "message_delta", "message_stop"]
    )
    start = events[0]
    assert isinstance(start, anthropic.types.RawMessageStartEvent)
    assert start.message.usage.output_tokens == 1  # placeholder, as the real API sends
    assert start.message.usage.input_tokens == 11
    assert start.message.content == [] and start.message.stop_reason is None
    text = "".join(
        e.delta.text
        for e in events
        if isinstance(e, anthropic.types.RawContentBlockDeltaEvent)
        and isinstance(e.delta, anthropic.types.TextDelta)
    )
    assert text == "abcdefghijklmnopqrstuvwxyz"
    delta = events[-2]
    assert isinstance(delta, anthropic.types.RawMessageDeltaEvent)
    assert delta.delta.stop_reason == "end_turn"
    assert delta.usage.output_tokens == 9


def test_wire_stream_has_pings_and_chunked_keepalive(server):
    """On the wire, streams carry ping events and chunked framing that keeps the connection."""
    server.enqueue(text_reply("abcdef", text_chunks=6), text_reply("second"))
    conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        body = {"model": MODEL, "max_tokens": 10, "messages": USER, "stream": True}
        conn.request("POST", "/v1/messages?beta=true", body=json.dumps(body))
        response = conn.getresponse()
        assert response.getheader("content-type", "").startswith("text/event-stream")
        assert response.getheader("transfer-encoding") == "chunked"
        assert response.getheader("request-id", "").startswith("req_")
        events = _sse_events(response.read())
        # the same connection serves the next (JSON) request
        conn.request("POST", "/v1/messages", body=json.dumps({**body, "stream": False}))
        second = conn.getresponse()
        assert json.loads(second.read())["content"][0]["text"] == "second"
        assert second.getheader("content-length") is not None
    finally:
        conn.close()
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names.count("ping") == 2  # after the first block start, then after 5 deltas
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)


def test_stream_helper_assembles_text_and_tool_input(server, client):
    """messages.stream() text_stream and get_final_message() assemble text and tool input."""
    tool_input = {"query": "weather in Paris", "days": [1, 2, 3], "units": {"temp": "C"}}
    server.enqueue(
        tool_use_reply(
            [("search", tool_input)],
            text="Let me look that up.",
            input_tokens=50,
            output_tokens=40,
            cache_read=10,
            json_chunks=6,
        )
    )
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == "Let me look that up."
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 40
    assert final.usage.input_tokens == 50 and final.usage.cache_read_input_tokens == 10
    tool = final.content[1]
    assert isinstance(tool, anthropic.types.ToolUseBlock)
    assert tool.input == tool_input and tool.id.startswith("toolu_")
    assert [r.stream for r in server.requests] == [True]


@needs_anthropic(0, 47, what="thinking blocks")
def test_thinking_block_streams_as_thinking_and_signature_deltas(server, client):
    """A thinking block is served whole as JSON, and streamed as thinking_delta events then one
    signature_delta, which the SDK's helper assembles into the same block."""
    reply = MessageReply(
        content=(ThinkingContent("Step one. Step two.", signature="sig_x"), TextContent("Done.")),
        text_chunks=3,
    )
    server.enqueue(reply, reply)
    whole = _create(client)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        final = stream.get_final_message()
    for message in (whole, final):
        thinking, text = message.content
        assert isinstance(thinking, anthropic.types.ThinkingBlock)
        assert (thinking.thinking, thinking.signature) == ("Step one. Step two.", "sig_x")
        assert isinstance(text, anthropic.types.TextBlock) and text.text == "Done."
    server.enqueue(reply)
    status, _, raw = _raw_post(
        server, {"model": MODEL, "max_tokens": 64, "messages": USER, "stream": True}
    )
    deltas = [data["delta"] for name, data in _sse_events(raw) if name == "content_block_delta"]
    assert status == 200
    assert [d["type"] for d in deltas[:4]] == ["thinking_delta"] * 3 + ["signature_delta"]


def test_async_stream_helper_get_final_message(server):
    """AsyncAnthropic messages.stream() returns the full text and scripted usage."""
    server.enqueue(text_reply("async streamed text", output_tokens=5))

    async def run() -> anthropic.types.Message:
        async with (
            anthropic.AsyncAnthropic(
                base_url=server.base_url, api_key="test", max_retries=0
            ) as aclient,
            aclient.messages.stream(model=MODEL, max_tokens=64, messages=USER) as st,
        ):
            return await st.get_final_message()

    final = asyncio.run(run())
    assert final.content[0].text == "async streamed text"  # type: ignore[union-attr]
    assert final.usage.output_tokens == 5


def test_mid_stream_error_event_raises_in_iterator(server, client):
    """An `event: error` after N deltas raises APIStatusError (status 200) carrying the body."""
    server.enqueue(text_reply("abcdefghij", text_chunks=10, stream_error_after=3))
    received = []
    with pytest.raises(anthropic.APIStatusError) as info:
        for event in _create(client, stream=True):
            received.append(event.type)
    # The SDK maps the error using the HTTP status of the stream, which was 200, so it is
    # neither OverloadedError nor InternalServerError.
    assert type(info.value) is anthropic.APIStatusError
    assert info.value.status_code == 200
    assert info.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert received.count("content_block_delta") == 3
    assert "message_delta" not in received


def test_cut_off_chunked_stream_raises_remote_protocol_error(server, client):
    """A chunked stream cut after N deltas raises httpx.RemoteProtocolError, not an SDK error."""
    server.enqueue(text_reply("abcdefghij", text_chunks=10, cut_after=4))
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        for event in _create(client, stream=True):
            received.append(event.type)
    assert received.count("content_block_delta") == 4
    # the client recovers on a fresh connection
    assert _create(client).content[0].text.startswith("Hello")  # type: ignore[union-attr]


def test_cut_off_close_framed_stream_ends_early_silently():
    """With Connection: close framing a cut stream ends early: get_final_message() is partial."""
    with (
        MessagesServer(sse_framing="close") as srv,
        anthropic.Anthropic(base_url=srv.base_url, api_key="test", max_retries=0) as cli,
    ):
        srv.enqueue(text_reply("abcdefghij", text_chunks=10, cut_after=4, output_tokens=9))
        with cli.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
            final = stream.get_final_message()
    assert final.content[0].text == "abcd"  # type: ignore[union-attr]
    assert final.stop_reason is None
    assert final.usage.output_tokens == 1  # the message_start placeholder, never updated


def test_slow_stream_delays_each_event_and_close_is_bounded():
    """A delay is waited before every event, and close() ends a slow stream promptly."""
    with (
        MessagesServer() as srv,
        anthropic.Anthropic(base_url=srv.base_url, api_key="test", max_retries=0) as cli,
    ):
        srv.enqueue(text_reply("abcd", text_chunks=4, ping_every=None, delay=0.02))
        started = time.monotonic()
        events = list(_create(cli, stream=True))
        elapsed = time.monotonic() - started
        # message_start, block_start, ping, 4 deltas, block_stop, message_delta, message_stop
        assert len(events) == 9
        assert elapsed >= 10 * 0.02 * 0.9

        srv.enqueue(text_reply("x" * 100, text_chunks=100, delay=1.0))
        stream = _create(cli, stream=True)
        srv.wait_for_requests(2)
        started = time.monotonic()
        srv.close()
        assert time.monotonic() - started < 3.0
        with pytest.raises(httpx.RemoteProtocolError):
            list(stream)


# --------------------------------------------------------------------------- HTTP errors


@pytest.mark.parametrize(
    ("status", "error_type", "exc_class"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError),
        (429, "rate_limit_error", anthropic.RateLimitError),
        (500, "api_error", anthropic.InternalServerError),
        (529, "overloaded_error", OVERLOADED),
    ],
)
def test_http_errors_map_to_sdk_exceptions(server, client, status, error_type, exc_class):
    """Each scripted HTTP error raises the SDK's class with the real error body and request id."""
    server.enqueue(error_reply(status, error_type, f"boom {status}", request_id="req_err"))
    with pytest.raises(anthropic.APIStatusError) as info:
        _create(client)
    assert type(info.value) is exc_class
    assert info.value.status_code == status
    assert info.value.request_id == "req_err"
    assert info.value.body == {
        "type": "error",
        "error": {"type": error_type, "message": f"boom {status}"},
    }


def test_http_error_on_stream_request_raises_before_iteration(server, client):
    """An error reply to a streamed request raises from create(stream=True) itself."""
    server.enqueue(error_reply(529))
    with pytest.raises(OVERLOADED):
        _create(client, stream=True)


def test_retry_after_is_honoured_with_one_retry(server):
    """With max_retries=1 the SDK waits retry-after after a 429 and gets the second reply."""
    server.enqueue(error_reply(429, retry_after=0.05), text_reply("after retry"))
    with anthropic.Anthropic(base_url=server.base_url, api_key="test", max_retries=1) as cli:
        message = _create(cli)
    assert message.content[0].text == "after retry"  # type: ignore[union-attr]
    first, second = server.requests
    assert second.headers["x-stainless-retry-count"] == "1"
    gap = second.received_at - first.received_at
    # the SDK's own backoff would be at least 0.375 s; retry-after asked for 0.05 s
    assert 0.04 <= gap < 0.37


# --------------------------------------------------------------------------- recording, scripting


def test_requests_are_recorded(server, client):
    """Every request is recorded with method, path, headers and parsed JSON body."""
    _create(client, system="be brief", stop_sequences=["END"])
    # SDK 2.14 no longer adds ?beta=true itself; send it as older SDKs did
    client.beta.messages.create(
        model=MODEL, max_tokens=8, messages=USER, extra_query={"beta": "true"}
    )
    plain, beta = server.requests
    assert (plain.method, plain.path, plain.route) == ("POST", "/v1/messages", "/v1/messages")
    assert plain.body == {
        "model": MODEL,
        "max_tokens": 64,
        "messages": USER,
        "system": "be brief",
        "stop_sequences": ["END"],
    }
    assert "anthropic-version" in plain.headers
    assert plain.headers["content-type"] == "application/json"
    assert not plain.stream
    assert beta.route == "/v1/messages" and beta.query == {"beta": ["true"]}


def test_invalid_requests_get_real_error_bodies(server):
    """Bodies that are not Messages requests get 400, unknown paths 404, without using the queue."""
    server.enqueue(text_reply("kept"))
    status, headers, raw = _raw_post(server, {"model": MODEL, "messages": USER})
    assert status == 400 and headers["request-id"].startswith("req_")
    assert json.loads(raw)["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    status, _, raw = _raw_post(server, b"not json")
    assert status == 400 and json.loads(raw)["type"] == "error"
    status, _, raw = _raw_post(server, {}, path="/v1/complete")
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    assert server.pending == 1
    assert len(server.requests) == 3


def test_responder_callable_drives_a_tool_loop(server, client):
    """A callable reply sees the request body and can answer the tool_use id it was sent back."""

    def responder(body: dict[str, Any]) -> MessageReply | ErrorReply:
        last = body["messages"][-1]
        if isinstance(last["content"], list) and last["content"][0]["type"] == "tool_result":
            result = last["content"][0]
            return text_reply(f"{result['tool_use_id']}={result['content']}")
        return tool_use_reply([ToolCall("add", {"a": 2, "b": 3}, id="toolu_add")])

    server.enqueue(responder, responder)
    messages: list[Any] = list(USER)
    first = client.messages.create(model=MODEL, max_tokens=64, messages=messages)
    tool = first.content[0]
    assert isinstance(tool, anthropic.types.ToolUseBlock)
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "5"}],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=64, messages=messages)
    assert second.content[0].text == "toolu_add=5"  # type: ignore[union-attr]


def test_responder_exception_becomes_500(server, client):
    """A responder that raises is reported to the client as a 500 api_error."""

    def broken(body: dict[str, Any]) -> MessageReply:
        raise RuntimeError("bug in test responder")

    server.enqueue(broken)
    with pytest.raises(anthropic.InternalServerError) as info:
        _create(client)
    assert "bug in test responder" in str(info.value)


# --------------------------------------------------------------------------- concurrency


def test_concurrent_thread_clients(server):
    """Many threads sharing one client get distinct messages, JSON and streamed."""
    with anthropic.Anthropic(base_url=server.base_url, api_key="test", max_retries=0) as cli:

        def call(i: int) -> str:
            if i % 2:
                with cli.messages.stream(model=MODEL, max_tokens=8, messages=USER) as st:
                    return st.get_final_message().id
            return _create(cli).id

        with ThreadPoolExecutor(max_workers=8) as pool:
            ids = list(pool.map(call, range(32)))
    assert len(set(ids)) == 32
    assert len(server.requests) == 32


def test_concurrent_asyncio_clients(server):
    """AsyncAnthropic requests gathered concurrently are all served and recorded."""
    server.enqueue(*(text_reply(f"reply {i}", delay=0.01) for i in range(10)))

    async def run() -> list[str]:
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="test", max_retries=0
        ) as aclient:

            async def one(stream: bool) -> str:
                if stream:
                    async with aclient.messages.stream(
                        model=MODEL, max_tokens=8, messages=USER
                    ) as st:
                        return await st.get_final_text()
                message = await aclient.messages.create(model=MODEL, max_tokens=8, messages=USER)
                return message.content[0].text  # type: ignore[union-attr]

            return await asyncio.gather(*(one(i % 2 == 0) for i in range(20)))

    texts = asyncio.run(run())
    assert sorted(t for t in texts if t.startswith("reply")) == sorted(
        f"reply {i}" for i in range(10)
    )
    assert len(server.requests) == 20


def test_close_is_idempotent_and_joins_threads():
    """close() can be called twice and leaves no server threads behind."""
    before = {t.ident for t in threading.enumerate()}
    srv = MessagesServer()
    with anthropic.Anthropic(base_url=srv.base_url, api_key="test") as cli:
        _create(cli)
        srv.close()
        srv.close()
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftover == []


def test_reply_builders_validate_arguments():
    """Reply builders refuse unbounded or contradictory options."""
    with pytest.raises(ValueError):
        text_reply("x", delay=60)
    with pytest.raises(ValueError):
        text_reply("x", stream_error_after=1, cut_after=1)
    with pytest.raises(ValueError):
        tool_use_reply([])
    with pytest.raises(ValueError):
        error_reply(200)
    assert error_reply(529).error_type == "overloaded_error"


# --------------------------------------------------------------------------- sessions


@needs_anthropic(2, 14, what="client.beta.sessions")
def test_session_events_list_send_and_stream(server: MessagesServer) -> None:
    """The sessions endpoints through the SDK: the history pages, a send appends the sent
    events and the responder's, and the stream delivers what is appended after it opened and
    ends after the session terminates."""
    sid = server.add_session(
        [session_event("session.status_running"), session_event("agent.message", content=[])],
        on_send=lambda sent: [session_event("session.status_terminated")],
    )

    async def main() -> tuple[list[Any], list[Any], Any]:
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="test", max_retries=0
        ) as client:
            events = client.beta.sessions.events
            listed = [e async for e in events.list(sid, limit=1)]
            stream = await events.stream(sid)
            sent = await events.send(
                sid, events=[{"type": "user.message", "content": [{"type": "text", "text": "hi"}]}]
            )
            streamed = [e async for e in stream]
            return listed, streamed, sent

    listed, streamed, sent = asyncio.run(main())
    assert [e.type for e in listed] == ["session.status_running", "agent.message"]
    assert [e.type for e in streamed] == ["user.message", "session.status_terminated"]
    assert sent.data is not None and sent.data[0].id.startswith("sevt_")
    assert [e["type"] for e in server.session_events(sid)][-2:] == [
        "user.message",
        "session.status_terminated",
    ]
    pages = [r.query.get("page") for r in server.requests if r.method == "GET"]
    assert pages[:2] == [None, ["1"]]


@needs_anthropic(2, 14, what="client.beta.sessions")
def test_session_refusal_and_unknown_session(server: MessagesServer) -> None:
    sid = server.add_session(on_send=lambda sent: error_reply(409, message="busy"))
    with anthropic.Anthropic(base_url=server.base_url, api_key="test", max_retries=0) as client:
        with pytest.raises(anthropic.ConflictError):
            client.beta.sessions.events.send(sid, events=[{"type": "user.interrupt"}])
        with pytest.raises(anthropic.NotFoundError):
            client.beta.sessions.events.send("sesn_missing", events=[{"type": "user.interrupt"}])
    assert server.session_events(sid) == []


@needs_anthropic(2, 14, what="client.beta.sessions")
def test_session_resource_status_follows_the_latest_status_event(server: MessagesServer) -> None:
    """``sessions.retrieve`` gets the session with the status its latest status event set:
    running before any, then idle, then terminated once deleted; an unknown id is a 404."""
    sid = server.add_session([session_event("agent.message", content=[])])
    with anthropic.Anthropic(base_url=server.base_url, api_key="test", max_retries=0) as client:
        statuses = [client.beta.sessions.retrieve(sid).status]
        server.append_session_events(sid, session_event("session.status_idle"))
        statuses.append(client.beta.sessions.retrieve(sid).status)
        server.append_session_events(
            sid, session_event("session.deleted"), session_event("agent.message", content=[])
        )
        statuses.append(client.beta.sessions.retrieve(sid).status)
        with pytest.raises(anthropic.NotFoundError):
            client.beta.sessions.retrieve("sesn_missing")
        retrieved = client.beta.sessions.retrieve(sid)
    assert statuses == ["running", "idle", "terminated"]
    assert retrieved.id == sid
