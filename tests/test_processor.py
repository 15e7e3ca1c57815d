"""AgentCapSpanProcessor: which finished model calls are indexed for the tool runs they cause."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

import otel_agentcap as ac
from otel_agentcap import causal_links
from otel_agentcap.model_calls import SDK_SCOPE, STOP_REASON, TOOL_USE_IDS
from otel_agentcap.processor import AgentCapSpanProcessor


@pytest.fixture
def sdk_tracer() -> Iterator[object]:
    provider = TracerProvider()
    provider.add_span_processor(AgentCapSpanProcessor())
    causal_links.clear()
    yield provider.get_tracer(SDK_SCOPE)
    causal_links.clear()


@pytest.mark.parametrize(
    ("stop_reason", "tool_use_ids", "by_response", "by_tool_use"),
    [
        ("tool_use", ("toolu_1",), True, True),
        ("tool_use", None, True, False),  # ids not recorded: found by the response id
        (None, None, True, False),  # unknown stop reason: indexed
        ("end_turn", None, False, False),  # asked for no tool
        ("stop_sequence", None, False, False),
        ("end_turn", ("toolu_1",), True, True),  # ids recorded: indexed whatever the reason
    ],
)
def test_model_calls_are_indexed_when_a_tool_run_may_look_for_them(
    sdk_tracer, stop_reason, tool_use_ids, by_response, by_tool_use
):
    with ac.run("run-index") as run, ac.agent("alpha"):
        span = sdk_tracer.start_span(  # type: ignore[attr-defined]
            "anthropic.messages.create", attributes={"gen_ai.operation.name": "chat"}
        )
        span.set_attribute("gen_ai.response.id", "msg_1")
        if stop_reason is not None:
            span.set_attribute(STOP_REASON, stop_reason)
        if tool_use_ids is not None:
            span.set_attribute(TOOL_USE_IDS, tool_use_ids)
        span.end()
        event_id = span.attributes["agentcap.event.id"]
    found = causal_links.model_call_for_response(run.run_id, "msg_1")
    assert (found is not None) == by_response
    if found is not None:
        assert found.event_id == event_id
    assert (causal_links.model_call_for_tool_use(run.run_id, "toolu_1") is not None) == by_tool_use
