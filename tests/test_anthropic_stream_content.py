# ruff: noqa: F811  (pytest fixtures imported from anthropic_support)
"""With content capture on, the output of every completed stream reaches the model_call event:
raw ``messages.create(stream=True)`` and ``messages.stream()``, sync and async, text and tool_use
blocks (the SDK records it only for its stream helpers)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from anthropic_support import (  # noqa: F401 (fixtures)
    API_KEY,
    MODEL,
    USER,
    captured,
    instrumented,
    only_model_call,
    server,
)

import otel_agentcap as ac
from otel_agentcap.testing.messages_server import MessagesServer, text_reply, tool_use_reply

pytestmark = pytest.mark.timeout(60)

TEXT = "The quick brown fox jumps over the lazy dog. " * 3
CONTENT = {"traces": {"content_mode": "content"}}


@pytest.fixture
def clients(server: MessagesServer, captured: Any) -> Iterator[tuple[Any, Any]]:
    options: dict[str, Any] = {"base_url": server.base_url, "api_key": API_KEY, "max_retries": 0}
    with anthropic.Anthropic(open_telemetry=CONTENT, **options) as sync_client:
        yield sync_client, anthropic.AsyncAnthropic(open_telemetry=CONTENT, **options)


def _raw(client: Any) -> list[Any]:
    return list(client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True))


def _helper(client: Any) -> list[Any]:
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        return list(stream)


async def _araw(client: Any) -> list[Any]:
    stream = await client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    return [event async for event in stream]


async def _ahelper(client: Any) -> list[Any]:
    async with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        return [event async for event in stream]


CASES = {
    "create(stream=True)": lambda clients: _raw(clients[0]),
    "stream()": lambda clients: _helper(clients[0]),
    "async create(stream=True)": lambda clients: asyncio.run(_araw(clients[1])),
    "async stream()": lambda clients: asyncio.run(_ahelper(clients[1])),
}


def _output_blocks(payload: dict[str, Any]) -> list[dict[str, Any]]:
    output = payload.get("content", {}).get("output_messages")
    assert output, f"no output content recorded: {payload.get('content')}"
    blocks: list[dict[str, Any]] = []
    for message in output:
        for part in message.get("parts") or message.get("content") or ():
            blocks.append(part)
    return blocks


@pytest.mark.parametrize("case", list(CASES))
def test_completed_stream_records_its_text_output(case, server, clients, captured, instrumented):
    """A stream read to the end, with content on, records the text it streamed."""
    server.enqueue(text_reply(TEXT, text_chunks=12))
    with ac.run(), ac.agent("a"):
        CASES[case](clients)
    payload = only_model_call(captured).payload
    assert payload["status"] == "ok" and payload["stream"] is True
    texts = [b.get("content") or b.get("text") for b in _output_blocks(payload)]
    assert TEXT in texts, _output_blocks(payload)


@pytest.mark.parametrize("case", list(CASES))
def test_completed_stream_records_its_tool_use_input(case, server, clients, captured, instrumented):
    """A stream read to the end, with content on, records its tool_use blocks with their input."""
    server.enqueue(tool_use_reply([("search", {"topic": "lamport clocks", "depth": 2})]))
    with ac.run(), ac.agent("a"):
        CASES[case](clients)
    blocks = _output_blocks(only_model_call(captured).payload)
    calls = [b for b in blocks if b.get("type") in ("tool_call", "tool_use")]
    assert len(calls) == 1, blocks
    arguments = calls[0].get("arguments", calls[0].get("input"))
    assert arguments == {"topic": "lamport clocks", "depth": 2}
