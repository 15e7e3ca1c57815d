# ruff: noqa: F811  (pytest fixtures imported from anthropic_support)
"""With content capture on, the output of every completed stream reaches the model_call event:
raw ``messages.create(stream=True)`` and ``messages.stream()``, sync and async, text, tool_use and
thinking blocks. The SDK's own span attributes stay exactly as the SDK sets them: it records the
output of its stream helper as ``gen_ai.output.messages`` and leaves a raw stream without output,
so a raw stream's output goes to agentcap's ``agentcap.model_call.output_messages``, and only when
the stream completed (read to its end, no error): a raw stream closed, dropped, failed or cut off
records no output anywhere."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable, Iterator
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
from opentelemetry.sdk.trace import ReadableSpan

import otel_agentcap as ac
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor
from otel_agentcap.pipeline.model_calls import is_sdk_scope
from otel_agentcap.testing import InMemoryEventExporter
from otel_agentcap.testing.messages_server import (
    MessageReply,
    MessagesServer,
    TextContent,
    ThinkingContent,
    ToolCall,
    text_reply,
    tool_use_reply,
)

pytestmark = pytest.mark.timeout(60)

TEXT = "The quick brown fox jumps over the lazy dog. " * 3
THOUGHT = "The user greets me. A greeting deserves an answer. " * 2
CONTENT = {"traces": {"content_mode": "content"}}
SDK_OUTPUT = "gen_ai.output.messages"
#: agentcap's attribute for a raw stream's output (documented; spelled out so it cannot drift).
OUTPUT_MESSAGES = "agentcap.model_call.output_messages"


def _options(server: MessagesServer) -> dict[str, Any]:
    return {"base_url": server.base_url, "api_key": API_KEY, "max_retries": 0}


@pytest.fixture
def clients(server: MessagesServer, captured: Any) -> Iterator[tuple[Any, Any]]:
    options = _options(server)
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


CASES: dict[str, Callable[[tuple[Any, Any]], Any]] = {
    "create(stream=True)": lambda clients: _raw(clients[0]),
    "stream()": lambda clients: _helper(clients[0]),
    "async create(stream=True)": lambda clients: asyncio.run(_araw(clients[1])),
    "async stream()": lambda clients: asyncio.run(_ahelper(clients[1])),
}
RAW = {"create(stream=True)", "async create(stream=True)"}


def _sdk_span(sink: InMemoryEventExporter) -> ReadableSpan:
    gc.collect()
    spans = [
        s
        for s in sink.spans
        if s.instrumentation_scope is not None and is_sdk_scope(s.instrumentation_scope.name)
    ]
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def _output_blocks(payload: dict[str, Any]) -> list[dict[str, Any]]:
    output = payload.get("content", {}).get("output_messages")
    assert output, f"no output content recorded: {payload.get('content')}"
    return [part for message in output for part in message["parts"]]


def _check_output_location(case: str, span: ReadableSpan, payload: dict[str, Any]) -> None:
    """The payload's output comes from the SDK's attribute where the SDK sets it (its helper),
    else from agentcap's; the SDK's span never gets an output the SDK did not set."""
    attributes = span.attributes or {}
    if case in RAW:
        assert SDK_OUTPUT not in attributes
        assert json.loads(str(attributes[OUTPUT_MESSAGES])) == payload["content"]["output_messages"]
    else:
        assert OUTPUT_MESSAGES not in attributes
        assert json.loads(str(attributes[SDK_OUTPUT])) == payload["content"]["output_messages"]


@pytest.mark.parametrize("case", list(CASES))
def test_completed_stream_records_its_text_output(case, server, clients, captured, instrumented):
    """A stream read to the end, with content on, records the text it streamed."""
    server.enqueue(text_reply(TEXT, text_chunks=12))
    with ac.run(), ac.agent("a"):
        CASES[case](clients)
    payload = only_model_call(captured).payload
    assert payload["status"] == "ok" and payload["stream"] is True
    assert {"type": "text", "content": TEXT} in _output_blocks(payload)
    _check_output_location(case, _sdk_span(captured), payload)


@pytest.mark.parametrize("case", list(CASES))
def test_completed_stream_records_its_tool_use_input(case, server, clients, captured, instrumented):
    """A stream read to the end, with content on, records its tool_use blocks with their input."""
    server.enqueue(
        tool_use_reply([("search", {"topic": "lamport clocks", "depth": 2})], text="Looking.")
    )
    with ac.run(), ac.agent("a"):
        CASES[case](clients)
    payload = only_model_call(captured).payload
    blocks = _output_blocks(payload)
    calls = [b for b in blocks if b["type"] == "tool_call"]
    assert len(calls) == 1, blocks
    assert calls[0]["name"] == "search"
    assert calls[0]["arguments"] == {"topic": "lamport clocks", "depth": 2}
    assert blocks[0] == {"type": "text", "content": "Looking."}
    _check_output_location(case, _sdk_span(captured), payload)


@pytest.mark.parametrize("case", list(CASES))
def test_completed_stream_records_its_thinking(case, server, clients, captured, instrumented):
    """A stream read to the end, with content on, records its thinking block as a reasoning part
    (without its signature) before its text."""
    server.enqueue(
        MessageReply(
            content=(ThinkingContent(THOUGHT, signature="sig_secret"), TextContent("Hello.")),
            text_chunks=7,
        )
    )
    with ac.run(), ac.agent("a"):
        CASES[case](clients)
    payload = only_model_call(captured).payload
    assert _output_blocks(payload) == [
        {"type": "reasoning", "content": THOUGHT},
        {"type": "text", "content": "Hello."},
    ]
    assert "sig_secret" not in json.dumps(payload)
    _check_output_location(case, _sdk_span(captured), payload)


def _sdk_attributes(span: ReadableSpan) -> dict[str, Any]:
    """The attributes the SDK set (the processor's stamps and agentcap's own left out); a timing
    compared by its type."""
    kept: dict[str, Any] = {}
    for key, value in (span.attributes or {}).items():
        if key.startswith("agentcap.") or key.startswith("gen_ai.agent."):
            continue
        kept[key] = type(value) if key == "gen_ai.response.time_to_first_chunk" else value
    return kept


REPLIES: dict[str, Callable[[], MessageReply]] = {
    "text": lambda: text_reply(TEXT, message_id="msg_same", request_id="req_same"),
    "tool_use": lambda: tool_use_reply(
        [ToolCall("search", {"q": "x"}, id="toolu_same")],
        text="Hm.",
        message_id="msg_same",
        request_id="req_same",
    ),
    "thinking": lambda: MessageReply(
        content=(ThinkingContent(THOUGHT, signature="sig_same"), TextContent("Yes.")),
        message_id="msg_same",
        request_id="req_same",
    ),
}


@pytest.mark.parametrize("reply", list(REPLIES))
@pytest.mark.parametrize("case", list(CASES))
def test_the_sdk_span_has_what_the_sdk_sets_without_the_instrumentation(
    case, reply, server, captured
):
    """Every attribute the SDK sets on a completed stream's span, and its status, are the same
    with the instrumentation as without it; only the instrumented raw stream has agentcap's
    output attribute."""
    seen = []
    for instrument in (False, True):
        instrumentor = AnthropicInstrumentor()
        if instrument:
            instrumentor.instrument()
        try:
            server.enqueue(REPLIES[reply]())
            with (
                anthropic.Anthropic(open_telemetry=CONTENT, **_options(server)) as sync_client,
                ac.run(),
                ac.agent("a"),
            ):
                # A new async client each time: one is bound to the event loop it first ran in.
                CASES[case](
                    (
                        sync_client,
                        anthropic.AsyncAnthropic(open_telemetry=CONTENT, **_options(server)),
                    )
                )
            span = _sdk_span(captured)
            seen.append((_sdk_attributes(span), span.status.status_code))
            assert (OUTPUT_MESSAGES in (span.attributes or {})) is (instrument and case in RAW)
        finally:
            if instrument:
                instrumentor.uninstrument()
        captured.clear()
    assert seen[0] == seen[1]
    assert "gen_ai.input.messages" in seen[0][0]
    assert (SDK_OUTPUT in seen[0][0]) is (case not in RAW)


@pytest.mark.parametrize("reply", list(REPLIES))
def test_raw_stream_output_reads_as_the_helpers(reply, server, clients, captured, instrumented):
    """A completed raw stream's recorded output is what the SDK records for the same reply read
    with its helper, block for block."""
    outputs = []
    for read in (_raw, _helper):
        server.enqueue(REPLIES[reply]())
        with ac.run(), ac.agent("a"):
            read(clients[0])
        outputs.append(only_model_call(captured).payload["content"]["output_messages"])
        captured.clear()
    assert outputs[0] == outputs[1]


# ------------------------------------------------------------ streams that did not complete


def _closed_early(client: Any) -> None:
    stream = client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    for index, _ in enumerate(stream):
        if index == 4:
            break
    stream.close()


def _closed_after_message_stop(client: Any) -> None:
    stream = client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    for event in stream:
        if event.type == "message_stop":
            break
    stream.close()


def _dropped(client: Any) -> None:
    stream = client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    for index, _ in enumerate(stream):
        if index == 4:
            break
    del stream
    gc.collect()


def _failed(client: Any) -> None:
    with pytest.raises(anthropic.APIStatusError):
        for _ in client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True):
            pass


async def _aclosed_early(client: Any) -> None:
    stream = await client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    index = 0
    async for _ in stream:
        index += 1
        if index == 5:
            break
    await stream.close()


async def _aclosed_after_message_stop(client: Any) -> None:
    stream = await client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    async for event in stream:
        if event.type == "message_stop":
            break
    await stream.close()


async def _afailed(client: Any) -> None:
    stream = await client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    with pytest.raises(anthropic.APIStatusError):
        async for _ in stream:
            pass


# case -> (how it is read, the reply's options, the payload's status)
UNFINISHED: dict[str, tuple[Callable[[tuple[Any, Any]], Any], dict[str, Any], str]] = {
    "closed early": (lambda c: _closed_early(c[0]), {}, "unset"),
    "closed after message_stop": (lambda c: _closed_after_message_stop(c[0]), {}, "unset"),
    "dropped": (lambda c: _dropped(c[0]), {}, "unset"),
    "error event": (lambda c: _failed(c[0]), {"stream_error_after": 5}, "error"),
    "async closed early": (lambda c: asyncio.run(_aclosed_early(c[1])), {}, "unset"),
    "async closed after message_stop": (
        lambda c: asyncio.run(_aclosed_after_message_stop(c[1])),
        {},
        "unset",
    ),
    "async error event": (
        lambda c: asyncio.run(_afailed(c[1])),
        {"stream_error_after": 5},
        "error",
    ),
}


@pytest.mark.parametrize("case", list(UNFINISHED))
def test_raw_stream_that_did_not_complete_records_no_output(
    case, server, clients, captured, instrumented
):
    """A raw stream closed (also right after message_stop), dropped or failed records no output,
    neither on the SDK's span nor in the payload; the rest of the call is recorded."""
    read, options, status = UNFINISHED[case]
    server.enqueue(text_reply(TEXT, text_chunks=12, **options))
    with ac.run(), ac.agent("a"):
        read(clients)
    payload = only_model_call(captured).payload
    assert payload["status"] == status and payload["stream"] is True
    assert "input_messages" in payload["content"]
    assert "output_messages" not in payload["content"]
    assert "partial_output_messages" not in payload["content"]
    attributes = _sdk_span(captured).attributes or {}
    assert OUTPUT_MESSAGES not in attributes and SDK_OUTPUT not in attributes


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_raw_stream_cut_off_records_no_output(asynchronous, captured, instrumented):
    """A raw stream whose body ends before message_stop, without an error the application sees,
    fails and records no output."""
    with MessagesServer(sse_framing="close") as srv:
        srv.enqueue(text_reply(TEXT, text_chunks=12, cut_after=6))
        with (
            anthropic.Anthropic(open_telemetry=CONTENT, **_options(srv)) as cli,
            ac.run(),
            ac.agent("a"),
        ):
            if asynchronous:
                acli = anthropic.AsyncAnthropic(open_telemetry=CONTENT, **_options(srv))
                asyncio.run(_araw(acli))
            else:
                _raw(cli)
    payload = only_model_call(captured).payload
    assert payload["status"] == "error"
    assert "output_messages" not in payload["content"]
    attributes = _sdk_span(captured).attributes or {}
    assert OUTPUT_MESSAGES not in attributes and SDK_OUTPUT not in attributes


def test_helper_stream_that_did_not_complete_keeps_what_was_read_as_partial(
    server, clients, captured, instrumented
):
    """The SDK's helper records what it read of a stream closed after message_stop; the payload
    keeps it as partial_output_messages, never as the Message's output."""
    server.enqueue(text_reply(TEXT, text_chunks=12))
    with (
        ac.run(),
        ac.agent("a"),
        clients[0].messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream,
    ):
        for event in stream:
            if event.type == "message_stop":
                break
    payload = only_model_call(captured).payload
    assert payload["status"] == "unset"
    assert "output_messages" not in payload["content"]
    partial = payload["content"]["partial_output_messages"]
    assert partial[0]["parts"] == [{"type": "text", "content": TEXT}]
    attributes = _sdk_span(captured).attributes or {}
    assert json.loads(str(attributes[SDK_OUTPUT])) == partial  # the SDK's, untouched
    assert OUTPUT_MESSAGES not in attributes


def test_content_off_records_no_stream_output(server, captured, instrumented):
    """Without the content mode a completed raw stream records no output anywhere."""
    server.enqueue(text_reply(TEXT))
    with anthropic.Anthropic(**_options(server)) as cli, ac.run(), ac.agent("a"):
        _raw(cli)
    payload = only_model_call(captured).payload
    assert payload["status"] == "ok" and "content" not in payload
    attributes = _sdk_span(captured).attributes or {}
    assert OUTPUT_MESSAGES not in attributes and SDK_OUTPUT not in attributes


def test_stream_output_is_bounded_by_the_clients_max_content_bytes(server, captured, instrumented):
    """A raw stream's output longer than the client's max_content_bytes is recorded as a
    truncation marker within that size."""
    long_text = "0123456789" * 2_000
    server.enqueue(text_reply(long_text, text_chunks=40))
    option = {"traces": {"content_mode": "content", "max_content_bytes": 5_000}}
    with (
        anthropic.Anthropic(open_telemetry=option, **_options(server)) as cli,
        ac.run(),
        ac.agent("a"),
    ):
        _raw(cli)
    recorded = str((_sdk_span(captured).attributes or {})[OUTPUT_MESSAGES])
    assert len(recorded.encode()) <= 5_000
    marker = only_model_call(captured).payload["content"]["output_messages"]
    assert marker["size"] > 20_000 and marker["$agentcap.truncated"].startswith('[{"role"')


def test_stream_output_is_stripped_for_the_collector(server, clients, captured, instrumented):
    """ContentStrippingExporter leaves agentcap's output attribute out of what it forwards."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_agentcap.exporters.strip_content import ContentStrippingExporter

    server.enqueue(text_reply(TEXT))
    with ac.run(), ac.agent("a"):
        _raw(clients[0])
    assert OUTPUT_MESSAGES in (_sdk_span(captured).attributes or {})
    collector = InMemorySpanExporter()
    ContentStrippingExporter(collector).export(captured.spans)
    assert not any(OUTPUT_MESSAGES in (s.attributes or {}) for s in collector.get_finished_spans())
