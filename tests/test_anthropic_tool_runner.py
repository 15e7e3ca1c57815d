"""The SDK's beta tool runner gives the same model -> tool -> model chain as ``run_tool_uses``:
sync and async, plain and streaming (also with ``run_tools_eagerly``), in memory and in the stored
PostgreSQL log."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import pytest
from anthropic import beta_async_tool, beta_tool
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

RUNS: dict[str, int] = {}


@beta_tool
def weather(city: str) -> str:
    """The weather in a city."""
    RUNS["weather"] = RUNS.get("weather", 0) + 1
    return f"sunny in {city}"


@beta_tool
def broken(city: str) -> str:
    """A tool that fails."""
    RUNS["broken"] = RUNS.get("broken", 0) + 1
    raise RuntimeError(f"no data for {city}")


@beta_async_tool
async def aweather(city: str) -> str:
    """The weather in a city (async)."""
    RUNS["aweather"] = RUNS.get("aweather", 0) + 1
    await asyncio.sleep(0)
    return f"sunny in {city}"


@beta_async_tool
async def abroken(city: str) -> str:
    """A tool that fails (async)."""
    RUNS["abroken"] = RUNS.get("abroken", 0) + 1
    raise RuntimeError(f"no data for {city}")


@pytest.fixture(autouse=True)
def _reset_runs() -> None:
    RUNS.clear()


def _script(server: MessagesServer, ok: str = "weather", bad: str = "broken") -> None:
    server.enqueue(
        tool_use_reply(
            [
                ToolCall(ok, {"city": "Oslo"}, id="toolu_w"),
                ToolCall(bad, {"city": "X"}, id="toolu_b"),
            ],
            input_tokens=20,
            output_tokens=9,
        ),
        text_reply("It is sunny in Oslo.", input_tokens=40, output_tokens=6),
    )


def _runner_kwargs(tools: list[Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": USER, "tools": tools}


def _check_sent_results(server: MessagesServer) -> None:
    """The runner sent back the SDK's own tool_result blocks and went on after the failure."""
    second = server.requests[1].body
    blocks = second["messages"][-1]["content"]
    assert blocks[0] == {
        "type": "tool_result",
        "tool_use_id": "toolu_w",
        "content": "sunny in Oslo",
    }
    assert blocks[1]["tool_use_id"] == "toolu_b" and blocks[1]["is_error"] is True
    assert "no data for X" in blocks[1]["content"]


def _check_spans(sink: InMemoryEventExporter) -> None:
    """The SDK's tool-run spans remain as plain spans; each captured execute_tool span is a
    child of one and is the only carrier of the tool's events."""
    sdk = {
        s.context.span_id: s for s in sink.spans if s.name.startswith("anthropic.custom_tool_use")
    }
    tool_spans = [
        s
        for s in sink.spans
        if (s.attributes or {}).get("agentcap.event.type") == "tool_invocation"
    ]
    assert len(sdk) == 2 and len(tool_spans) == 2
    for span in tool_spans:
        assert span.parent is not None and span.parent.span_id in sdk
    for span in sdk.values():
        assert "agentcap.event.id" not in (span.attributes or {})
        assert (span.attributes or {}).get("agentcap.agent.id")


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_sync_runner_chain(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
    stream: bool,
) -> None:
    _script(server)
    with ac.run(f"r-runner-{stream}"), ac.agent("assistant"):
        runner = client.beta.messages.tool_runner(
            **_runner_kwargs([weather, broken]), stream=stream
        )
        if stream:
            for message_stream in runner:
                for _ in message_stream:
                    pass
            final = runner.until_done()
        else:
            final = runner.until_done()
    assert final.content[0].text == "It is sunny in Oslo."  # type: ignore[union-attr]
    assert RUNS == {"weather": 1, "broken": 1}
    _check_sent_results(server)
    check_tool_chain(runner_events(captured, f"r-runner-{stream}"))
    _check_spans(captured)


def test_sync_runner_eager_tools(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """With run_tools_eagerly the tools run while the reply still streams: their parent is the
    model call whose span is still open."""
    _script(server)
    with ac.run("r-runner-eager"), ac.agent("assistant"):
        runner = client.beta.messages.tool_runner(
            **_runner_kwargs([weather, broken]), stream=True, run_tools_eagerly=True
        )
        for message_stream in runner:
            for _ in message_stream:
                pass
    assert RUNS == {"weather": 1, "broken": 1}
    _check_sent_results(server)
    check_tool_chain(runner_events(captured, "r-runner-eager"))


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_async_runner_chain(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
    stream: bool,
) -> None:
    _script(server, "aweather", "abroken")

    async def main() -> Any:
        async with aclient:
            runner = aclient.beta.messages.tool_runner(
                **_runner_kwargs([aweather, abroken]), stream=stream
            )
            return await runner.until_done()

    with ac.run(f"r-arunner-{stream}"), ac.agent("assistant"):
        final = asyncio.run(main())
    assert final.content[0].text == "It is sunny in Oslo."
    assert RUNS == {"aweather": 1, "abroken": 1}
    _check_sent_results(server)
    check_tool_chain(runner_events(captured, f"r-arunner-{stream}"))
    _check_spans(captured)


def test_async_runner_eager_tools(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    _script(server, "aweather", "abroken")

    async def main() -> None:
        async with aclient:
            runner = aclient.beta.messages.tool_runner(
                **_runner_kwargs([aweather, abroken]), stream=True, run_tools_eagerly=True
            )
            async for message_stream in runner:
                async for _ in message_stream:
                    pass

    with ac.run("r-arunner-eager"), ac.agent("assistant"):
        asyncio.run(main())
    assert RUNS == {"aweather": 1, "abroken": 1}
    check_tool_chain(runner_events(captured, "r-arunner-eager"))


def test_tool_runs_in_another_agent(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """The runner driven by a spawned agent: its events are that agent's, the chain holds."""
    _script(server)
    with ac.run("r-runner-worker"), ac.agent("planner") as planner:
        worker = planner.spawn("worker")
        worker.run(
            lambda: client.beta.messages.tool_runner(
                **_runner_kwargs([weather, broken])
            ).until_done()
        )
    events = runner_events(captured, "r-runner-worker")
    check_tool_chain(events)
    agents = {e["agent_id"] for e in events if e["event_type"] != "agent_start"}
    assert worker.agent_id in agents
    tool_agents = {e["agent_id"] for e in events if e["event_type"] == "tool_invocation"}
    assert tool_agents == {worker.agent_id}


def test_every_run_the_sdk_makes_runs_and_is_recorded_as_an_attempt(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """By default a second run of the same tool_use id runs the tool again, as the SDK does without
    the instrumentation, and is recorded as the invocation's second attempt."""
    _script(server)
    with ac.run("r-runner-again"), ac.agent("assistant"):
        runner = client.beta.messages.tool_runner(**_runner_kwargs([weather, broken]))
        runner.until_done()
        first_reply = runner._thread.messages[1]  # the assistant's tool_use reply
        blocks = [b for b in first_reply["content"] if getattr(b, "type", None) == "tool_use"]
        again = [runner._run_tool(t, b) for t, b in zip([weather, broken], blocks, strict=True)]
    assert RUNS == {"weather": 2, "broken": 2}
    assert again[0]["content"] == "sunny in Oslo"
    assert again[1]["is_error"] is True and "no data for X" in str(again[1]["content"])
    events = runner_events(captured, "r-runner-again")
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    assert sorted(e["payload"].get("attempt", 1) for e in invocations) == [1, 1, 2, 2]
    assert len({e["event_id"] for e in events}) == len(events)


def test_exactly_once_per_tool_use_id_when_the_runner_opts_in(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """A runner opted in with exactly_once(): a second run of the same tool_use id (same tool and
    input) in the agent returns the recorded outcome (and the recorded error) without running the
    tool again, as Tool.invoke does."""
    from otel_agentcap.instrumentation.anthropic import exactly_once

    _script(server)
    with ac.run("r-runner-once"), ac.agent("assistant"):
        runner = exactly_once(client.beta.messages.tool_runner(**_runner_kwargs([weather, broken])))
        runner.until_done()
        first_reply = runner._thread.messages[1]  # the assistant's tool_use reply
        blocks = [b for b in first_reply["content"] if getattr(b, "type", None) == "tool_use"]
        again = [runner._run_tool(t, b) for t, b in zip([weather, broken], blocks, strict=True)]
    assert RUNS == {"weather": 1, "broken": 1}
    assert again[0]["content"] == "sunny in Oslo"
    assert again[1]["is_error"] is True and "no data for X" in str(again[1]["content"])
    events = runner_events(captured, "r-runner-once")
    assert len([e for e in events if e["event_type"] == "tool_invocation"]) == 2


def test_outside_an_agent_nothing_is_captured(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    _script(server)
    final = client.beta.messages.tool_runner(**_runner_kwargs([weather, broken])).until_done()
    assert final.content[0].text == "It is sunny in Oslo."
    assert RUNS == {"weather": 1, "broken": 1}
    _check_sent_results(server)
    assert captured.events == []


def test_uninstrument_restores_the_runner(
    server: MessagesServer, client: anthropic.Anthropic, captured: InMemoryEventExporter
) -> None:
    from anthropic.lib.tools._beta_runner import BaseAsyncToolRunner, BaseSyncToolRunner

    originals = (BaseSyncToolRunner._run_tool, BaseAsyncToolRunner._run_tool)
    instrumentor = AnthropicInstrumentor()
    instrumentor.instrument()
    try:
        assert BaseSyncToolRunner._run_tool is not originals[0]
    finally:
        instrumentor.uninstrument()
    assert (BaseSyncToolRunner._run_tool, BaseAsyncToolRunner._run_tool) == originals
    _script(server)
    with ac.run("r-runner-plain"), ac.agent("assistant"):
        client.beta.messages.tool_runner(**_runner_kwargs([weather, broken])).until_done()
    assert not [e for e in captured.events if e.event_type == "tool_invocation"]


@pytest.mark.storage
def test_runner_chain_stored_in_postgres(
    server: MessagesServer,
    client: anthropic.Anthropic,
    instrumented: AnthropicInstrumentor,
    stored: Any,
    pg_dsn: str,
) -> None:
    """The chain of the sync runner (plain and streaming) and the async one, in the stored log."""
    for stream in (False, True):
        _script(server)
        with ac.run(f"r-pg-runner-{stream}"), ac.agent("assistant"):
            client.beta.messages.tool_runner(
                **_runner_kwargs([weather, broken]), stream=stream
            ).until_done()
        check_tool_chain(stored_events(pg_dsn, f"r-pg-runner-{stream}"))

    _script(server, "aweather", "abroken")

    async def main() -> None:
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="sk-ant-test", max_retries=0
        ) as aclient:
            await aclient.beta.messages.tool_runner(
                **_runner_kwargs([aweather, abroken])
            ).until_done()

    with ac.run("r-pg-arunner"), ac.agent("assistant"):
        asyncio.run(main())
    check_tool_chain(stored_events(pg_dsn, "r-pg-arunner"))
    assert conflict_count(pg_dsn) == 0


def test_memory_tool_chain(
    server: MessagesServer,
    client: anthropic.Anthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
    tmp_path: Any,
) -> None:
    """The SDK's memory tool (a builtin function tool) runs through the same hook."""
    from anthropic.lib.tools._beta_builtin_memory_tool import BetaLocalFilesystemMemoryTool

    inputs = {
        "toolu_w": {"command": "create", "path": "/memories/plan.txt", "file_text": "clocks"},
        "toolu_b": {"command": "view", "path": "/memories/missing.txt"},
    }
    server.enqueue(
        tool_use_reply(
            [
                ToolCall("memory", inputs["toolu_w"], id="toolu_w"),
                ToolCall("memory", inputs["toolu_b"], id="toolu_b"),
            ]
        ),
        text_reply("Noted."),
    )
    memory = BetaLocalFilesystemMemoryTool(base_path=str(tmp_path))
    with ac.run("r-runner-memory"), ac.agent("assistant"):
        client.beta.messages.tool_runner(**_runner_kwargs([memory])).until_done()
    assert (tmp_path / "memories" / "plan.txt").read_text() == "clocks"
    check_tool_chain(runner_events(captured, "r-runner-memory"), inputs, "does not exist")


class _InputKeeper:
    """An SDK tool as the runners see one: ``name`` and ``call(input)``; it keeps what it got and
    clears it, as a tool may."""

    name = "keeper"

    def __init__(self) -> None:
        self.got: list[object] = []

    def call(self, input: dict[str, Any]) -> str:
        self.got.append(input)
        input.clear()
        return "done"


@pytest.mark.parametrize("once", [False, True])
def test_a_captured_sdk_tool_gets_the_very_input_object_the_runner_passes(once: bool) -> None:
    """The runner's own records of a call read its input after the tool ran (anthropic 2.16's
    session span records the arguments "as the tool left them"): the tool must get the runner's
    dict, not a copy, or a tool that changes it is recorded unchanged (a regression the SDK's
    own test suite showed under the instrumentation)."""
    from types import SimpleNamespace

    from otel_agentcap.instrumentation.anthropic import tool_runner

    keeper = _InputKeeper()
    tool_use = SimpleNamespace(id="toolu_keep", name="keeper", input={"x": 1})
    with ac.run(f"keep-{once}"), ac.agent("worker"):
        prepared = tool_runner._prepare_tool(
            (keeper, tool_use), {}, tool_name="tool", use_name="tool_use", is_async=False, once=once
        )
        assert prepared is not None
        runnable = prepared[0][0]
        given = {"x": 1}
        assert runnable.call(given) == "done"
    assert keeper.got == [given] and keeper.got[0] is given
    assert given == {}
