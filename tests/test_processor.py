"""AgentCapSpanProcessor: which finished model calls of the real anthropic SDK (over HTTP to the
local Messages server) are indexed for the tool runs they may cause."""

from __future__ import annotations

import anthropic
import pytest
from anthropic_support import MODEL, RECORDS_TOOL_USE_IDS, USER, needs_sdk_tracing

import otel_agentcap as ac
from otel_agentcap.pipeline import causal_links
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    ToolCall,
    text_reply,
    tool_use_reply,
)

pytestmark = pytest.mark.timeout(60)


def _call(client: anthropic.Anthropic, run_id: str) -> tuple[bool, bool]:
    """Make one model call in a run; returns what was indexed for it while the run was open."""
    with ac.run(run_id), ac.agent("alpha"):
        client.messages.create(model=MODEL, max_tokens=64, messages=USER)  # type: ignore[arg-type]
        return _indexed(run_id)


def _indexed(run_id: str) -> tuple[bool, bool]:
    by_response = causal_links.model_call_for_response(run_id, "msg_index")
    by_tool_use = causal_links.model_call_for_tool_use(run_id, "toolu_index")
    return by_response is not None, by_tool_use is not None


@pytest.mark.parametrize(
    ("reply", "indexed"),
    [
        (text_reply("done", message_id="msg_index"), (False, False)),  # end_turn: no tool asked
        (
            text_reply(
                "done", stop_reason="stop_sequence", stop_sequence="##", message_id="msg_index"
            ),
            (False, False),
        ),
        (text_reply("cut", stop_reason="max_tokens", message_id="msg_index"), (True, False)),
        (
            tool_use_reply(
                [ToolCall("weather", {"city": "Oslo"}, id="toolu_index")], message_id="msg_index"
            ),
            (True, RECORDS_TOOL_USE_IDS),
        ),
    ],
)
def test_model_calls_are_indexed_when_a_tool_run_may_look_for_them(
    server: MessagesServer, client, captured, instrumented, reply, indexed
):
    server.enqueue(reply)
    run_id = f"run-index-{len(server.requests)}-{reply.stop_reason}"
    assert _call(client, run_id) == indexed
    assert _indexed(run_id) == (False, False)  # released with the run


@needs_sdk_tracing
def test_without_the_instrumentor_a_tool_asking_call_is_found_by_its_response_id(
    server: MessagesServer, client, captured
):
    """No tool_use ids are recorded without the instrumentor; the response id still finds it."""
    causal_links.clear()
    server.enqueue(
        tool_use_reply(
            [ToolCall("weather", {"city": "Oslo"}, id="toolu_index")], message_id="msg_index"
        )
    )
    assert _call(client, "run-index-plain") == (True, False)
    causal_links.clear()
