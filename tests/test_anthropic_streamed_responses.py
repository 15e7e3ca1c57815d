# ruff: noqa: F811  (pytest fixtures imported from anthropic_support)
"""A non-streamed ``messages.create`` read through ``with_streaming_response`` (sync, async,
beta) records its response like any other call: response id, usage, stop reason, the requested
tool_use ids (so ``run_tool_uses`` finds the model call) and, with content on, its output. What
the caller gets is unchanged."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import pytest
from anthropic_support import (  # noqa: F401 (fixtures)
    API_KEY,
    MODEL,
    USER,
    aclient,
    captured,
    client,
    expected_tool_use_ids,
    instrumented,
    needs_anthropic,
    only_model_call,
    server,
)

import otel_agentcap as ac
from otel_agentcap.testing import InMemoryEventExporter
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    ToolCall,
    text_reply,
    tool_use_reply,
)

pytestmark = [
    pytest.mark.timeout(60),
    needs_anthropic(2, 16, what="the SDK's finish_api_call_span, where the hook is"),
]

TEXT = "A reply read as raw bytes."


def _reply() -> Any:
    return text_reply(TEXT, input_tokens=10, output_tokens=7, cache_read=5, cache_creation=3)


def _parse(messages: Any) -> Any:
    with messages.with_streaming_response.create(
        model=MODEL, max_tokens=64, messages=USER
    ) as response:
        return response.parse()


def _check_recorded(payload: dict[str, Any], response_id: str) -> None:
    assert payload["response_id"] == response_id
    assert payload["stop_reason"] == "end_turn"
    assert payload["usage"] == {
        "input_tokens": 18,
        "output_tokens": 7,
        "cache_read_input_tokens": 5,
        "cache_creation_input_tokens": 3,
    }
    assert payload["status"] == "ok" and payload["stream"] is False


def test_parsed_streaming_response_records_the_response(server, client, captured, instrumented):
    """with_streaming_response + parse() records the response id, usage and stop reason."""
    server.enqueue(_reply())
    with ac.run("r-wsr"), ac.agent("a"):
        message = _parse(client.messages)
    assert isinstance(message, anthropic.types.Message)
    assert message.content[0].text == TEXT  # type: ignore[union-attr]
    _check_recorded(only_model_call(captured).payload, message.id)


def test_streaming_response_read_as_bytes_records_the_response(
    server, client, captured, instrumented
):
    """Reading the body with iter_bytes() gives the caller every byte and records the call."""
    server.enqueue(_reply())
    with (
        ac.run("r-wsr-bytes"),
        ac.agent("a"),
        client.beta.messages.with_streaming_response.create(
            model=MODEL, max_tokens=64, messages=USER
        ) as response,
    ):
        body = b"".join(response.iter_bytes(chunk_size=7))
    data = json.loads(body)
    assert data["content"][0]["text"] == TEXT
    _check_recorded(only_model_call(captured).payload, data["id"])


def test_async_streaming_response_records_the_response(server, aclient, captured, instrumented):
    """The async client's with_streaming_response records the response too."""
    server.enqueue(_reply())

    async def call() -> Any:
        with ac.run("r-wsr-async"), ac.agent("a"):
            async with aclient.messages.with_streaming_response.create(
                model=MODEL, max_tokens=64, messages=USER
            ) as response:
                return await response.parse()

    message = asyncio.run(call())
    _check_recorded(only_model_call(captured).payload, message.id)


def test_unread_streaming_response_records_no_response(server, client, captured, instrumented):
    """A streaming response left unread records no response, as before."""
    server.enqueue(_reply())
    with (
        ac.run("r-wsr-unread"),
        ac.agent("a"),
        client.messages.with_streaming_response.create(model=MODEL, max_tokens=64, messages=USER),
    ):
        pass
    payload = only_model_call(captured).payload
    assert payload["status"] == "unset"
    assert "response_id" not in payload and "stop_reason" not in payload


def test_streaming_response_tool_use_chain(server, client, captured, instrumented):
    """run_tool_uses on a parsed streaming response names its model call as the tool's cause."""

    @ac.tool
    def weather(city: str) -> str:
        return f"sunny in {city}"

    server.enqueue(tool_use_reply([ToolCall("weather", {"city": "Oslo"}, id="toolu_s")]))
    with ac.run("r-wsr-tools"), ac.agent("a"):
        message = _parse(client.messages)
        ac.run_tool_uses(message, [weather])
    call = only_model_call(captured)
    assert call.payload["tool_use_ids"] == expected_tool_use_ids("toolu_s")
    (invocation,) = captured.of_type("tool_invocation")
    assert call.event_id in invocation.causal_parent_ids


@pytest.mark.parametrize("content", [True, False])
def test_streaming_response_output_follows_content_mode(
    server: MessagesServer, captured: InMemoryEventExporter, instrumented: Any, content: bool
) -> None:
    """With content on the output is recorded; with it off no text of the reply is."""
    server.enqueue(_reply())
    options: Any = {"traces": {"content_mode": "content"}} if content else {}
    with (
        anthropic.Anthropic(
            base_url=server.base_url, api_key=API_KEY, max_retries=0, open_telemetry=options
        ) as content_client,
        ac.run(f"r-wsr-content-{content}"),
        ac.agent("a"),
    ):
        _parse(content_client.messages)
    payload = only_model_call(captured).payload
    if content:
        assert payload["content"]["output_messages"] == [
            {"role": "assistant", "parts": [{"type": "text", "content": TEXT}]}
        ]
    else:
        assert "content" not in payload
        assert TEXT not in json.dumps([dict(s.attributes or {}) for s in captured.spans])
