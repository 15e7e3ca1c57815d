"""StreamedBlocks builds a streamed Message's content blocks from its raw events: the same blocks
as the whole Message, only once message_stop arrived, never from an event it could not read."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.instrumentation.anthropic.stream_blocks import StreamedBlocks
from otel_agentcap.testing.messages_server import (
    MessageReply,
    TextContent,
    ThinkingContent,
    ToolCall,
)
from otel_agentcap.testing.messages_server.replies import resolve

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_blocks = st.one_of(
    st.builds(TextContent, st.text(min_size=1, max_size=40)),
    st.builds(ThinkingContent, st.text(min_size=1, max_size=40), st.text(max_size=10)),
    st.builds(
        ToolCall,
        st.text(min_size=1, max_size=10),
        st.dictionaries(st.text(max_size=6), _json_values, max_size=4),
    ),
)
_replies = st.builds(
    MessageReply,
    content=st.lists(_blocks, min_size=1, max_size=4).map(tuple),
    text_chunks=st.integers(1, 8),
    json_chunks=st.integers(1, 8),
)


def _events(reply: MessageReply) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The stream events of ``reply`` as the API sends them, and the content of its Message."""
    counter = itertools.count()
    resolved = resolve(reply, {"model": "m", "messages": []}, lambda p: f"{p}_{next(counter)}")
    events = [event for _, event in resolved.events()]
    return events, resolved.message(complete=True)["content"]


@settings(max_examples=150, deadline=None)
@given(_replies)
def test_blocks_of_a_complete_stream_are_the_messages_content(reply):
    """Every event of a stream read: complete, and the blocks are the whole Message's content."""
    events, content = _events(reply)
    blocks = StreamedBlocks()
    for event in events:
        blocks.add(event)
    assert blocks.complete
    assert blocks.blocks() == content


@settings(max_examples=150, deadline=None)
@given(_replies, st.data())
def test_a_stream_without_message_stop_is_not_complete(reply, data):
    """Any prefix of a stream that stops before message_stop is not complete."""
    events, _ = _events(reply)
    cut = data.draw(st.integers(0, len(events) - 1))
    blocks = StreamedBlocks()
    for event in events[:cut]:
        blocks.add(event)
    assert not blocks.complete


def test_an_event_it_cannot_read_breaks_the_message():
    """A delta for a block that never started, or a text delta without its text, leaves no
    blocks and no completion, whatever follows."""
    for bad in (
        {"type": "content_block_delta", "index": 7, "delta": {"type": "text_delta", "text": "x"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}},
    ):
        events, _ = _events(MessageReply(content=(TextContent("hello"),)))
        blocks = StreamedBlocks()
        for event in [*events[:3], bad, *events[3:]]:
            blocks.add(event)
        assert not blocks.complete and blocks.blocks() is None


def test_tool_input_that_is_not_json_gives_no_blocks():
    """A tool_use block whose streamed input is not JSON gives no blocks (None), not a guess."""
    blocks = StreamedBlocks()
    for event in (
        {"type": "message_start", "message": {}},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "t", "name": "n", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": '{"a": '},
        },
        {"type": "message_stop"},
    ):
        blocks.add(event)
    assert blocks.blocks() is None


def test_unknown_deltas_are_ignored_and_events_are_not_changed():
    """A delta of a type it does not know is skipped, as the SDK's accumulation skips it; the
    events it reads are left as they were."""
    start = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    events = [
        {"type": "message_start", "message": {}},
        start,
        {"type": "content_block_delta", "index": 0, "delta": {"type": "future_delta", "x": 1}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
        {"type": "message_stop"},
    ]
    blocks = StreamedBlocks()
    for event in events:
        blocks.add(event)
    assert blocks.blocks() == [{"type": "text", "text": "hi"}]
    assert start["content_block"] == {"type": "text", "text": ""}
