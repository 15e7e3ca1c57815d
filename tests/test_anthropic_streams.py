"""The stored model_call event of the SDK's own spans in every stream lifecycle case, sync and
async, with token accounting and errors (real anthropic client over HTTP, MessagesServer)."""

from __future__ import annotations

import asyncio
import gc

import anthropic
import pytest
from anthropic_support import MODEL, USER, only_model_call

import otel_agentcap as ac
from otel_agentcap.testing.messages_server import MessagesServer, error_reply, text_reply

pytestmark = pytest.mark.timeout(60)

TEXT = "The quick brown fox jumps over the lazy dog, " * 4

# The SDK's class for a 529 (releases without OverloadedError raise InternalServerError).
OVERLOADED = getattr(anthropic, "OverloadedError", anthropic.InternalServerError)


def _reply(**extra: object) -> object:
    options = {"input_tokens": 10, "output_tokens": 87, "cache_read": 5, "cache_creation": 3}
    options.update(extra)
    return text_reply(TEXT, text_chunks=20, **options)  # type: ignore[arg-type]


def _stream(client: anthropic.Anthropic) -> object:
    return client.messages.create(model=MODEL, max_tokens=256, messages=USER, stream=True)


def test_non_streamed_call_records_usage_with_cache_tokens(server, client, captured, instrumented):
    """A plain create records model, ids, stop reason and usage with cache tokens counted in."""
    server.enqueue(_reply())
    with ac.run("r-plain"), ac.agent("a"):
        message = client.messages.create(model=MODEL, max_tokens=256, messages=USER)
    payload = only_model_call(captured).payload
    assert payload["response_id"] == message.id
    assert payload["request_id"] == message._request_id
    assert payload["model"] == MODEL
    assert payload["stop_reason"] == "end_turn"
    assert payload["usage"] == {
        "input_tokens": 18,
        "output_tokens": 87,
        "cache_read_input_tokens": 5,
        "cache_creation_input_tokens": 3,
    }
    assert payload["status"] == "ok" and payload["stream"] is False
    assert payload["latency_ms"] > 0


def test_exhausted_stream(server, client, captured):
    """A stream read to the end records final usage (no message_start placeholder) and OK."""
    server.enqueue(_reply())
    with ac.run("r-exhaust"), ac.agent("a"):
        events = list(_stream(client))  # type: ignore[call-overload]
    assert events[-1].type == "message_stop"
    payload = only_model_call(captured).payload
    assert payload["usage"]["output_tokens"] == 87
    assert payload["usage"]["input_tokens"] == 18
    assert payload["stop_reason"] == "end_turn"
    assert payload["status"] == "ok" and payload["stream"] is True
    assert payload["time_to_first_chunk_ms"] > 0


def test_stream_closed_early(server, client, captured):
    """close() part way records one unfinished call: no stop reason, no output tokens."""
    server.enqueue(_reply())
    with ac.run("r-close"), ac.agent("a"):
        stream = _stream(client)
        for index, _ in enumerate(stream):  # type: ignore[call-overload]
            if index == 4:
                break
        stream.close()  # type: ignore[attr-defined]
    payload = only_model_call(captured).payload
    assert payload["status"] == "unset"
    assert "stop_reason" not in payload
    assert "output_tokens" not in payload["usage"]
    assert payload["usage"]["input_tokens"] == 18


def test_stream_broken_out_of_and_dropped(server, client, captured):
    """Breaking out of a stream and dropping it still records the call once."""
    server.enqueue(_reply())
    with ac.run("r-drop"), ac.agent("a"):
        stream = _stream(client)
        for index, _ in enumerate(stream):  # type: ignore[call-overload]
            if index == 2:
                break
        del stream
        gc.collect()
    payload = only_model_call(captured).payload
    assert payload["status"] == "unset"
    assert "output_tokens" not in payload["usage"]


def test_error_event_mid_stream(server, client, captured):
    """An error event part way raises the SDK's error unchanged and records its type."""
    server.enqueue(_reply(stream_error_after=3))
    with ac.run("r-err"), ac.agent("a"), pytest.raises(anthropic.APIStatusError) as raised:
        for _ in _stream(client):  # type: ignore[call-overload]
            pass
    assert raised.value.type == "overloaded_error"  # type: ignore[attr-defined]
    payload = only_model_call(captured).payload
    assert payload["status"] == "error"
    assert payload["error_type"] == "overloaded_error"
    assert "output_tokens" not in payload["usage"]


def test_stream_cut_off(captured):
    """A stream cut off before its final events is recorded as failed, without output usage."""
    with MessagesServer(sse_framing="close") as srv:
        srv.enqueue(_reply(cut_after=3))
        cli = anthropic.Anthropic(base_url=srv.base_url, api_key="k", max_retries=0)
        with ac.run("r-cut"), ac.agent("a"):
            try:
                for _ in _stream(cli):  # type: ignore[call-overload]
                    pass
            except anthropic.APIError:
                pass
    payload = only_model_call(captured).payload
    assert payload["status"] == "error"
    assert "stop_reason" not in payload
    assert "output_tokens" not in payload["usage"]


def test_exception_inside_with_block(server, client, captured, instrumented):
    """The user's exception inside messages.stream() passes through; the call is recorded once."""
    server.enqueue(_reply())
    with (
        ac.run("r-with"),
        ac.agent("a"),
        pytest.raises(KeyError),
        client.messages.stream(model=MODEL, max_tokens=256, messages=USER) as stream,
    ):
        for _ in stream.text_stream:
            raise KeyError("user bug")
    payload = only_model_call(captured).payload
    assert payload["status"] == "unset"
    assert payload["stream"] is True


def test_http_errors_reach_the_user_unchanged(server, client, captured, instrumented):
    """Rate limit and overloaded errors are raised as the SDK raises them and recorded."""
    server.enqueue(error_reply(429, retry_after=0), error_reply(529))
    with ac.run("r-http"), ac.agent("a"):
        with pytest.raises(anthropic.RateLimitError):
            client.messages.create(model=MODEL, max_tokens=8, messages=USER)
        with pytest.raises(OVERLOADED):
            client.messages.create(model=MODEL, max_tokens=8, messages=USER)
    types = [e.payload["error_type"] for e in captured.of_type("model_call")]
    assert types == ["rate_limit_error", "overloaded_error"]


def test_connection_error_recorded(captured, instrumented):
    """A connection failure raises APIConnectionError and records connection_error."""
    cli = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="k", max_retries=0)
    with ac.run("r-conn"), ac.agent("a"), pytest.raises(anthropic.APIConnectionError):
        cli.messages.create(model=MODEL, max_tokens=8, messages=USER)
    assert only_model_call(captured).payload["error_type"] == "connection_error"


# ----------------------------------------------------------------------------------- async


def _arun(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_async_exhausted_closed_and_error(server, aclient, captured, instrumented):
    """Async streams: exhausted, closed early and failing mid-stream each record one event."""
    server.enqueue(_reply(), _reply(), _reply(stream_error_after=2))

    async def main() -> None:
        stream = await aclient.messages.create(
            model=MODEL, max_tokens=256, messages=USER, stream=True
        )
        async for _ in stream:
            pass
        stream = await aclient.messages.create(
            model=MODEL, max_tokens=256, messages=USER, stream=True
        )
        async for _ in stream:
            break
        await stream.close()
        with pytest.raises(anthropic.APIStatusError):
            async with aclient.messages.stream(
                model=MODEL, max_tokens=256, messages=USER
            ) as helper:
                await helper.get_final_message()

    with ac.run("r-async"), ac.agent("a"):
        _arun(main())
    gc.collect()
    calls = captured.of_type("model_call")
    assert [c.payload["status"] for c in calls] == ["ok", "unset", "error"]
    assert calls[0].payload["usage"]["output_tokens"] == 87
    assert "output_tokens" not in calls[1].payload["usage"]
    assert calls[2].payload["error_type"] == "overloaded_error"


def test_async_exception_inside_with_block(server, aclient, captured, instrumented):
    """An exception in an async messages.stream() block passes through; one event is recorded."""
    server.enqueue(_reply())

    async def main() -> None:
        async with aclient.messages.stream(model=MODEL, max_tokens=256, messages=USER) as s:
            async for _ in s.text_stream:
                raise ValueError("user bug")

    with ac.run("r-async-with"), ac.agent("a"), pytest.raises(ValueError):
        _arun(main())
    assert only_model_call(captured).payload["status"] == "unset"


def test_async_dropped_stream(server, aclient, captured):
    """An async stream broken out of and dropped records one unfinished call."""
    server.enqueue(_reply())

    async def main() -> None:
        stream = await aclient.messages.create(
            model=MODEL, max_tokens=256, messages=USER, stream=True
        )
        async for _ in stream:
            break
        del stream
        gc.collect()

    with ac.run("r-async-drop"), ac.agent("a"):
        _arun(main())
    assert only_model_call(captured).payload["status"] == "unset"
