"""Toolset members (``BetaRunnableToolset`` / ``BetaAsyncRunnableToolset``) give the same model
-> tool -> model chain as function tools: in the Messages tool runner (sync and async, plain,
streaming and eager) and in a loop of the user's own that calls ``toolset.tool_result``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import anthropic
import pytest
from anthropic.lib.tools import BetaAsyncRunnableToolset, BetaRunnableToolset
from anthropic.lib.tools._toolsets import BetaToolsetCallContext
from anthropic.types.beta import BetaToolUseBlock
from anthropic_support import (
    MODEL,
    USER,
    check_tool_chain,
    conflict_count,
    runner_events,
    stored_events,
)

import otel_agentcap as ac
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor
from otel_agentcap.testing import InMemoryEventExporter
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    ToolCall,
    text_reply,
    tool_use_reply,
)

pytestmark = pytest.mark.timeout(120)

INPUTS = {"toolu_w": {"url": "https://example.com"}, "toolu_b": {"selector": "#missing"}}


class Browser(BetaRunnableToolset):
    """A browser toolset whose ``navigate`` works and whose ``click`` fails."""

    toolset_name: ClassVar[Literal["browser"]] = "browser"

    def __init__(self) -> None:
        self.runs: list[str] = []

    def to_dict(self) -> Any:
        return {"type": "browser_toolset_20260801"}

    def call(self, context: BetaToolsetCallContext, name: str, input: Mapping[str, object]) -> str:
        self.runs.append(name)
        assert context.tool_use is not None and context.tool_use.name == name
        if name == "click":
            raise RuntimeError(f"no element {input['selector']}")
        return f"opened {input['url']}"


class AsyncBrowser(BetaAsyncRunnableToolset):
    """:class:`Browser` for the async runner."""

    toolset_name: ClassVar[Literal["browser"]] = "browser"

    def __init__(self) -> None:
        self.runs: list[str] = []

    def to_dict(self) -> Any:
        return {"type": "browser_toolset_20260801"}

    async def call(
        self, context: BetaToolsetCallContext, name: str, input: Mapping[str, object]
    ) -> str:
        self.runs.append(name)
        await asyncio.sleep(0)
        if name == "click":
            raise RuntimeError(f"no element {input['selector']}")
        return f"opened {input['url']}"


def _script(server: MessagesServer) -> None:
    server.enqueue(
        tool_use_reply(
            [
                ToolCall("navigate", INPUTS["toolu_w"], id="toolu_w", toolset_name="browser"),
                ToolCall("click", INPUTS["toolu_b"], id="toolu_b", toolset_name="browser"),
            ],
            input_tokens=20,
            output_tokens=9,
        ),
        text_reply("The page is open.", input_tokens=40, output_tokens=6),
    )


def _kwargs(toolset: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": USER, "tools": [toolset]}


def _check(server: MessagesServer, captured: InMemoryEventExporter, run_id: str) -> None:
    """The runner sent the toolset's own result blocks, and the log holds the chain."""
    blocks = server.requests[1].body["messages"][-1]["content"]
    assert blocks[0] == {
        "type": "tool_result",
        "tool_use_id": "toolu_w",
        "toolset_name": "browser",
        "content": "opened https://example.com",
    }
    assert blocks[1]["is_error"] is True and "no element #missing" in str(blocks[1]["content"])
    events = runner_events(captured, run_id)
    check_tool_chain(events, INPUTS, "no element #missing")
    names = {e["payload"]["tool"] for e in events if e["event_type"] == "tool_invocation"}
    assert names == {"navigate", "click"}


@pytest.mark.parametrize("mode", ["create", "stream", "eager"])
def test_sync_runner_toolset_chain(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
    mode: str,
) -> None:
    _script(server)
    browser = Browser()
    run_id = f"r-toolset-{mode}"
    with ac.run(run_id), ac.agent("assistant"):
        if mode == "create":
            client.beta.messages.tool_runner(**_kwargs(browser)).until_done()
        else:
            runner = client.beta.messages.tool_runner(
                **_kwargs(browser), stream=True, run_tools_eagerly=mode == "eager"
            )
            for message_stream in runner:
                for _ in message_stream:
                    pass
    assert browser.runs == ["navigate", "click"]
    _check(server, captured, run_id)


@pytest.mark.parametrize("mode", ["create", "stream", "eager"])
def test_async_runner_toolset_chain(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
    mode: str,
) -> None:
    _script(server)
    browser = AsyncBrowser()

    async def main() -> None:
        async with aclient:
            if mode == "create":
                await aclient.beta.messages.tool_runner(**_kwargs(browser)).until_done()
                return
            runner = aclient.beta.messages.tool_runner(
                **_kwargs(browser), stream=True, run_tools_eagerly=mode == "eager"
            )
            async for message_stream in runner:
                async for _ in message_stream:
                    pass

    run_id = f"r-atoolset-{mode}"
    with ac.run(run_id), ac.agent("assistant"):
        asyncio.run(main())
    assert browser.runs == ["navigate", "click"]
    _check(server, captured, run_id)


def test_toolset_in_a_loop_of_ones_own(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """``toolset.tool_result(block)`` after ``messages.create`` (no runner) gives the chain too."""
    _script(server)
    browser = Browser()
    tools: Any = [browser.to_dict()]
    with ac.run("r-toolset-own"), ac.agent("assistant"):
        reply = client.beta.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=tools)
        blocks = [b for b in reply.content if isinstance(b, BetaToolUseBlock)]
        results: Any = [browser.tool_result(b) for b in blocks]
        client.beta.messages.create(
            model=MODEL,
            max_tokens=64,
            tools=tools,
            messages=[
                *USER,
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": results},
            ],
        )
    assert browser.runs == ["navigate", "click"]
    _check(server, captured, "r-toolset-own")


def test_a_member_run_again_calls_the_toolset_again(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """By default a second run of a member tool_use id calls the toolset again, as without the
    instrumentation, and another toolset instance answering the same id raises or returns its
    own outcome; both runs are recorded, the second as the next attempt."""
    _script(server)
    browser = Browser()
    with ac.run("r-toolset-again"), ac.agent("assistant"):
        runner = client.beta.messages.tool_runner(**_kwargs(browser))
        runner.until_done()
        first_reply = runner._thread.messages[1]
        blocks = [b for b in first_reply["content"] if isinstance(b, BetaToolUseBlock)]
        again = [browser.tool_result(b) for b in blocks]
        other = Browser()
        other_results = [other.tool_result(b) for b in blocks]
    assert browser.runs == ["navigate", "click", "navigate", "click"]
    assert other.runs == ["navigate", "click"]
    assert again[0]["content"] == "opened https://example.com"
    assert other_results[0]["content"] == "opened https://example.com"
    events = runner_events(captured, "r-toolset-again")
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    assert sorted(e["payload"].get("attempt", 1) for e in invocations) == [1, 1, 2, 2, 3, 3]


def test_exactly_once_per_member_tool_use_id(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """A toolset opted in with exactly_once(): a second run of a member tool_use id in the agent
    returns the recorded result (and the recorded error, as an error result) without calling the
    toolset again."""
    from otel_agentcap.instrumentation.anthropic import exactly_once

    _script(server)
    browser = exactly_once(Browser())
    with ac.run("r-toolset-once"), ac.agent("assistant"):
        runner = client.beta.messages.tool_runner(**_kwargs(browser))
        runner.until_done()
        first_reply = runner._thread.messages[1]  # the assistant's tool_use reply
        blocks = [b for b in first_reply["content"] if isinstance(b, BetaToolUseBlock)]
        again = [browser.tool_result(b) for b in blocks]
    assert browser.runs == ["navigate", "click"]
    assert again[0]["content"] == "opened https://example.com"
    assert again[1].get("is_error") is True and "no element #missing" in str(again[1]["content"])
    events = runner_events(captured, "r-toolset-once")
    assert len([e for e in events if e["event_type"] == "tool_invocation"]) == 2


def test_an_unhashable_toolset_can_be_opted_in(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """A toolset that cannot be a dict key (it defines __eq__) is opted in all the same."""
    from otel_agentcap.instrumentation.anthropic import exactly_once

    class EqualBrowser(Browser):
        def __eq__(self, other: object) -> bool:
            return isinstance(other, EqualBrowser)

    _script(server)
    browser = exactly_once(EqualBrowser())
    with ac.run("r-toolset-unhashable"), ac.agent("assistant"):
        runner = client.beta.messages.tool_runner(**_kwargs(browser))
        runner.until_done()
        first_reply = runner._thread.messages[1]
        blocks = [b for b in first_reply["content"] if isinstance(b, BetaToolUseBlock)]
        for block in blocks:
            browser.tool_result(block)
    assert browser.runs == ["navigate", "click"]


def test_async_exactly_once_per_member_tool_use_id(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """A runner opted in with exactly_once(): the members it runs again return the recorded
    outcome without calling the toolset again."""
    from otel_agentcap.instrumentation.anthropic import exactly_once

    _script(server)
    browser = AsyncBrowser()

    async def main() -> list[Any]:
        async with aclient:
            runner = exactly_once(aclient.beta.messages.tool_runner(**_kwargs(browser)))
            await runner.until_done()
            first_reply = runner._thread.messages[1]
            blocks = [b for b in first_reply["content"] if isinstance(b, BetaToolUseBlock)]
            return [await runner._run_toolset_member(b) for b in blocks]

    with ac.run("r-atoolset-once"), ac.agent("assistant"):
        again = asyncio.run(main())
    assert browser.runs == ["navigate", "click"]
    assert again[0]["content"] == "opened https://example.com"
    assert again[1].get("is_error") is True
    events = runner_events(captured, "r-atoolset-once")
    assert len([e for e in events if e["event_type"] == "tool_invocation"]) == 2


def test_outside_an_agent_the_toolset_is_left_alone(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    _script(server)
    browser = Browser()
    final = client.beta.messages.tool_runner(**_kwargs(browser)).until_done()
    assert final.content[0].text == "The page is open."  # type: ignore[union-attr]
    assert browser.runs == ["navigate", "click"]
    blocks = server.requests[1].body["messages"][-1]["content"]
    assert blocks[0]["content"] == "opened https://example.com"
    assert blocks[1]["is_error"] is True
    assert captured.events == []


def test_uninstrument_restores_the_toolsets(
    server: MessagesServer, client: anthropic.Anthropic, captured: InMemoryEventExporter
) -> None:
    from anthropic.lib.tools._beta_runner import BaseAsyncToolRunner, BaseSyncToolRunner

    originals = (
        BetaRunnableToolset.tool_result,
        BetaAsyncRunnableToolset.tool_result,
        BaseSyncToolRunner._run_toolset_member,
        BaseAsyncToolRunner._run_toolset_member,
    )
    instrumentor = AnthropicInstrumentor()
    instrumentor.instrument()
    try:
        assert BetaRunnableToolset.tool_result is not originals[0]
        assert BaseSyncToolRunner._run_toolset_member is not originals[2]
    finally:
        instrumentor.uninstrument()
    assert (
        BetaRunnableToolset.tool_result,
        BetaAsyncRunnableToolset.tool_result,
        BaseSyncToolRunner._run_toolset_member,
        BaseAsyncToolRunner._run_toolset_member,
    ) == originals
    _script(server)
    with ac.run("r-toolset-plain"), ac.agent("assistant"):
        client.beta.messages.tool_runner(**_kwargs(Browser())).until_done()
    assert not [e for e in captured.events if e.event_type == "tool_invocation"]


@pytest.mark.storage
def test_toolset_chain_stored_in_postgres(
    server: MessagesServer,
    client: anthropic.Anthropic,
    instrumented: AnthropicInstrumentor,
    stored: Any,
    pg_dsn: str,
) -> None:
    _script(server)
    with ac.run("r-pg-toolset"), ac.agent("assistant"):
        client.beta.messages.tool_runner(**_kwargs(Browser())).until_done()
    check_tool_chain(stored_events(pg_dsn, "r-pg-toolset"), INPUTS, "no element #missing")
    assert conflict_count(pg_dsn) == 0


def test_a_member_capture_cannot_take_runs_unchanged(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """A tool_use id that cannot be an invocation id (it holds U+001F): the member runs as the
    SDK runs it, uncaptured, and the runner goes on."""
    server.enqueue(
        tool_use_reply(
            [ToolCall("navigate", INPUTS["toolu_w"], id="toolu_\x1fw", toolset_name="browser")]
        ),
        text_reply("The page is open."),
    )
    browser = Browser()
    with ac.run("r-toolset-odd"), ac.agent("assistant"):
        final = client.beta.messages.tool_runner(**_kwargs(browser)).until_done()
    assert final.content[0].text == "The page is open."  # type: ignore[union-attr]
    assert browser.runs == ["navigate"]
    blocks = server.requests[1].body["messages"][-1]["content"]
    assert blocks[0]["content"] == "opened https://example.com"
    assert not [e for e in captured.events if e.event_type == "tool_invocation"]
