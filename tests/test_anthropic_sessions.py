"""The Sessions tool runner (``client.beta.sessions.events.tool_runner``, async only) runs each
tool of an ``agent.custom_tool_use`` / ``agent.tool_use`` event through a captured tool: the
invocation id is the session event's id, a tool runs once per event id even when the runner
dispatches the event again after a failed post, and the results reach the session unchanged.
Driven over real HTTP against the local server's sessions endpoints."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic import beta_async_tool, beta_tool
from anthropic.lib.tools.agent_toolset import AgentToolContext, beta_agent_toolset_20260401
from anthropic_support import conflict_count, needs_anthropic, runner_events, stored_events

import otel_agentcap as ac
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor
from otel_agentcap.testing import InMemoryEventExporter
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    error_reply,
    session_event,
)

#: anthropic 2.16 rewrote the sessions tool runner: a result post the session refuses is posted
#: again (the call ran once); before, the runner reconnected and dispatched the call again.
_SDK_POSTS_AGAIN = tuple(int(p) for p in anthropic.__version__.split(".")[:2]) >= (2, 16)
#: How many times each tool of CUSTOM_CALLS runs when its first result post is refused, uncaptured
#: or captured without exactly-once, and the attempts recorded per invocation.
_RUNS_AFTER_REFUSAL = 1 if _SDK_POSTS_AGAIN else 2
_ATTEMPTS_AFTER_REFUSAL = sorted(
    (call, attempt)
    for call in ("sevt_b", "sevt_w")
    for attempt in range(1, _RUNS_AFTER_REFUSAL + 1)
)

pytestmark = pytest.mark.timeout(120)

RUNS: dict[str, int] = {}


@beta_tool
def weather(city: str) -> str:
    """The weather in a city (sync: the runner calls it on a worker thread)."""
    RUNS["weather"] = RUNS.get("weather", 0) + 1
    return f"sunny in {city}"


@beta_async_tool
async def forecast(city: str) -> str:
    """A forecast that fails (async)."""
    RUNS["forecast"] = RUNS.get("forecast", 0) + 1
    await asyncio.sleep(0)
    raise RuntimeError(f"no data for {city}")


@pytest.fixture(autouse=True)
def _reset_runs() -> None:
    RUNS.clear()


def _end_of_turn(results: set[str], expected: set[str]) -> list[dict[str, Any]]:
    """The agent's next events once every expected result has arrived."""
    if not expected <= results:
        return []
    return [
        session_event("session.status_running"),
        session_event("agent.message", content=[{"type": "text", "text": "Done."}]),
        session_event("session.status_idle", stop_reason={"type": "end_turn"}),
    ]


def _result_id(event: dict[str, Any]) -> str:
    return str(event.get("custom_tool_use_id") or event.get("tool_use_id"))


def _session(
    server: MessagesServer, calls: list[dict[str, Any]], *, refuse_first_post: bool = False
) -> str:
    """A session whose agent asked for ``calls`` and waits for their results. With
    ``refuse_first_post`` the first post of each result is refused (400) and the session's streams
    drop, so the runner reconnects, reads the history and dispatches the call again."""
    expected = {c["id"] for c in calls}
    received: set[str] = set()
    refused: set[str] = set()
    sid = ""

    def on_send(sent: list[dict[str, Any]]) -> Any:
        ids = {_result_id(e) for e in sent}
        if refuse_first_post and not ids <= refused:
            refused.update(ids)
            server.drop_session_streams(sid)
            return error_reply(400, message="result refused once")
        received.update(ids)
        return _end_of_turn(received, expected)

    sid = server.add_session(
        [
            session_event("session.status_running"),
            *calls,
            session_event(
                "session.status_idle",
                stop_reason={"type": "requires_action", "event_ids": sorted(expected)},
            ),
        ],
        on_send=on_send,
    )
    return sid


CUSTOM_CALLS = [
    session_event("agent.custom_tool_use", id="sevt_w", name="weather", input={"city": "Oslo"}),
    session_event("agent.custom_tool_use", id="sevt_b", name="forecast", input={"city": "X"}),
]


def _run(
    aclient: anthropic.AsyncAnthropic, sid: str, tools: list[Any]
) -> list[anthropic.lib.tools._beta_session_runner.DispatchedToolCall]:
    async def main() -> list[Any]:
        async with aclient:
            runner = aclient.beta.sessions.events.tool_runner(sid, tools=tools, max_idle=0.3)
            return [call async for call in runner]

    return asyncio.run(main())


def _posted(server: MessagesServer, sid: str) -> dict[str, dict[str, Any]]:
    return {
        _result_id(e): e
        for e in server.session_events(sid)
        if e["type"] in ("user.custom_tool_result", "user.tool_result")
    }


def check_session_chain(events: list[dict[str, Any]], inputs: dict[str, Any], error: str) -> None:
    """tool_invocation (invocation id = the session event id, arguments = its input) ->
    tool_result / agent_error, once per event; no model call of the log is a parent (the model
    ran on the server)."""
    by_id = {e["event_id"]: e for e in events}
    assert not [e for e in events if e["event_type"] == "model_call"]
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    assert sorted(e["payload"]["invocation_id"] for e in invocations) == sorted(inputs)
    for invocation in invocations:
        assert invocation["payload"]["arguments"] == inputs[invocation["payload"]["invocation_id"]]
        assert all(by_id[p]["event_type"] != "model_call" for p in invocation["parents"])
    outcomes = {
        e["payload"]["invocation_id"]: e
        for e in events
        if e["event_type"] in ("tool_result", "agent_error")
    }
    assert sorted(outcomes) == sorted(inputs)
    for outcome in outcomes.values():
        invocation = next(
            i
            for i in invocations
            if i["payload"]["invocation_id"] == outcome["payload"]["invocation_id"]
        )
        assert outcome["parents"] == [invocation["event_id"]]
        assert outcome["seq"] > invocation["seq"]
    errors = [e for e in outcomes.values() if e["event_type"] == "agent_error"]
    assert len(errors) == 1 and error in errors[0]["payload"]["message"]


def test_session_runner_chain(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    sid = _session(server, CUSTOM_CALLS)
    with ac.run("r-session"), ac.agent("worker"):
        calls = _run(aclient, sid, [weather, forecast])
    assert RUNS == {"weather": 1, "forecast": 1}
    assert [(c.tool_use_id, c.is_error, c.posted) for c in calls] == [
        ("sevt_w", False, True),
        ("sevt_b", True, True),
    ]
    posted = _posted(server, sid)
    assert posted["sevt_w"]["content"] == [{"type": "text", "text": "sunny in Oslo"}]
    assert posted["sevt_b"]["is_error"] is True
    assert "no data for X" in posted["sevt_b"]["content"][0]["text"]
    inputs = {"sevt_w": {"city": "Oslo"}, "sevt_b": {"city": "X"}}
    check_session_chain(runner_events(captured, "r-session"), inputs, "no data for X")
    # Each captured execute_tool span is the child of the SDK's tool span of the session.
    sdk = {s.context.span_id: s for s in captured.spans if s.name.startswith("anthropic.custom")}
    ours = [s for s in captured.spans if s.name.startswith("execute_tool")]
    assert len(sdk) == 2 and len(ours) == 2
    for span in ours:
        assert span.parent is not None and span.parent.span_id in sdk
    for span in sdk.values():
        assert (span.attributes or {}).get("anthropic.session.id") == sid


def test_session_runner_runs_a_tool_again_when_the_sdk_does(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """A post the session refuses leaves the call unanswered; after reconnecting, the runner
    dispatches it again and, as without the instrumentation, the tool runs again: the second
    run is recorded as the next attempt of the invocation."""
    sid = _session(server, CUSTOM_CALLS, refuse_first_post=True)
    with ac.run("r-session-again"), ac.agent("worker"):
        _run(aclient, sid, [weather, forecast])
    events = runner_events(captured, "r-session-again")
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    attempts = sorted(
        (e["payload"]["invocation_id"], e["payload"].get("attempt", 1)) for e in invocations
    )
    n = _RUNS_AFTER_REFUSAL
    assert {"weather": n, "forecast": n} == RUNS
    assert attempts == _ATTEMPTS_AFTER_REFUSAL


def test_session_runner_runs_a_tool_once_per_event_when_opted_in(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """With exactly-once tools switched on for every runner, a call the runner dispatches again
    does not run again: the recorded result (and the recorded error) is posted. (From 2.16 a
    runner dispatches a call once; the second-runner tests below cover a call dispatched
    again.)"""
    from otel_agentcap.instrumentation.anthropic import set_exactly_once_default

    sid = _session(server, CUSTOM_CALLS, refuse_first_post=True)
    set_exactly_once_default(True)
    try:
        with ac.run("r-session-once"), ac.agent("worker"):
            calls = _run(aclient, sid, [weather, forecast])
    finally:
        set_exactly_once_default(False)
    assert RUNS == {"weather": 1, "forecast": 1}
    dispatched = [(c.tool_use_id, c.posted) for c in calls]
    first_posted = _SDK_POSTS_AGAIN
    assert dispatched[:2] == [("sevt_w", first_posted), ("sevt_b", first_posted)]
    assert {tool_use_id for tool_use_id, posted in dispatched if posted} == {"sevt_w", "sevt_b"}
    posted = _posted(server, sid)
    if not _SDK_POSTS_AGAIN:  # 2.16 posts the refusal as the result instead
        assert posted["sevt_w"]["content"] == [{"type": "text", "text": "sunny in Oslo"}]
    assert posted["sevt_b"]["is_error"] is True
    inputs = {"sevt_w": {"city": "Oslo"}, "sevt_b": {"city": "X"}}
    check_session_chain(runner_events(captured, "r-session-once"), inputs, "no data for X")


def _two_runners(
    aclient: anthropic.AsyncAnthropic, server: MessagesServer, *, exactly_once: bool
) -> tuple[list[Any], list[Any], str]:
    """A first runner runs both CUSTOM_CALLS but none of its result posts reaches the session
    (every post refused), as when a process dies between a tool's side effect and its post; it
    is closed after dispatching both. A second runner on the same session then finds both calls
    unanswered and dispatches them again, with the session accepting posts."""
    from otel_agentcap.instrumentation.anthropic import set_exactly_once_default

    accepting = False
    received: set[str] = set()

    def on_send(sent: list[dict[str, Any]]) -> Any:
        if not accepting:
            return error_reply(400, message="not now")
        received.update(_result_id(e) for e in sent)
        return _end_of_turn(received, {"sevt_w", "sevt_b"})

    sid = server.add_session(
        [
            session_event("session.status_running"),
            *CUSTOM_CALLS,
            session_event(
                "session.status_idle",
                stop_reason={"type": "requires_action", "event_ids": ["sevt_b", "sevt_w"]},
            ),
        ],
        on_send=on_send,
    )

    async def main() -> tuple[list[Any], list[Any]]:
        nonlocal accepting
        async with aclient:
            first: list[Any] = []
            runner = aclient.beta.sessions.events.tool_runner(
                sid, tools=[weather, forecast], max_idle=0.3
            )
            async with contextlib.aclosing(aiter(runner)) as calls:
                async for call in calls:
                    first.append(call)
                    if {c.tool_use_id for c in first} == {"sevt_w", "sevt_b"}:
                        break
            accepting = True
            runner = aclient.beta.sessions.events.tool_runner(
                sid, tools=[weather, forecast], max_idle=0.3
            )
            return first, [call async for call in runner]

    set_exactly_once_default(exactly_once)
    try:
        first, second = asyncio.run(main())
    finally:
        set_exactly_once_default(False)
    return first, second, sid


@needs_anthropic(2, 16, what="a runner closed after refused posts closes cleanly")
def test_a_second_runner_posts_the_recorded_outcome_when_opted_in(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """With exactly-once tools on, a call whose result never reached the session is not run
    again by the next runner on the session: the outcome recorded by the first is posted."""
    with ac.run("r-session-second"), ac.agent("worker"):
        first, second, sid = _two_runners(aclient, server, exactly_once=True)
    assert not any(c.posted for c in first)
    assert RUNS == {"weather": 1, "forecast": 1}
    assert {c.tool_use_id for c in second if c.posted} == {"sevt_w", "sevt_b"}
    posted = _posted(server, sid)
    assert posted["sevt_w"]["content"] == [{"type": "text", "text": "sunny in Oslo"}]
    assert posted["sevt_b"]["is_error"] is True
    inputs = {"sevt_w": {"city": "Oslo"}, "sevt_b": {"city": "X"}}
    check_session_chain(runner_events(captured, "r-session-second"), inputs, "no data for X")


@needs_anthropic(2, 16, what="a runner closed after refused posts closes cleanly")
def test_a_second_runner_runs_the_tools_again_by_default(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """Without exactly-once, the second runner runs both tools again, as the SDK does; each run
    is recorded as the next attempt of its invocation."""
    with ac.run("r-session-second-again"), ac.agent("worker"):
        _, second, sid = _two_runners(aclient, server, exactly_once=False)
    assert {c.tool_use_id for c in second if c.posted} == {"sevt_w", "sevt_b"}
    assert RUNS == {"weather": 2, "forecast": 2}
    assert _posted(server, sid)["sevt_w"]["content"] == [{"type": "text", "text": "sunny in Oslo"}]
    invocations = [
        e
        for e in runner_events(captured, "r-session-second-again")
        if e["event_type"] == "tool_invocation"
    ]
    attempts = sorted(
        (e["payload"]["invocation_id"], e["payload"].get("attempt", 1)) for e in invocations
    )
    assert attempts == [("sevt_b", 1), ("sevt_b", 2), ("sevt_w", 1), ("sevt_w", 2)]


def test_session_runner_agent_toolset(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
    tmp_path: Path,
) -> None:
    """The agent toolset's tools (``agent.tool_use`` events, answered with ``user.tool_result``)."""
    (tmp_path / "notes.txt").write_text("clocks and logs\n")
    calls = [
        session_event("agent.tool_use", id="sevt_r", name="read", input={"file_path": "notes.txt"}),
        session_event("agent.tool_use", id="sevt_m", name="read", input={"file_path": "gone.txt"}),
    ]
    sid = _session(server, calls)

    async def main() -> None:
        async with aclient, AgentToolContext(workdir=tmp_path) as env:
            runner = aclient.beta.sessions.events.tool_runner(
                sid, tools=beta_agent_toolset_20260401(env), max_idle=0.3
            )
            await runner.until_done()

    with ac.run("r-session-toolset"), ac.agent("worker"):
        asyncio.run(main())
    posted = _posted(server, sid)
    assert posted["sevt_r"]["content"] == [{"type": "text", "text": "clocks and logs\n"}]
    assert posted["sevt_m"]["is_error"] is True
    inputs = {"sevt_r": {"file_path": "notes.txt"}, "sevt_m": {"file_path": "gone.txt"}}
    check_session_chain(runner_events(captured, "r-session-toolset"), inputs, "gone.txt")


def test_outside_an_agent_the_session_runner_is_left_alone(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    sid = _session(server, CUSTOM_CALLS, refuse_first_post=True)
    calls = _run(aclient, sid, [weather, forecast])
    # Uncaptured, the tools run as often as the SDK runs them.
    assert RUNS["weather"] >= _RUNS_AFTER_REFUSAL and RUNS["forecast"] >= _RUNS_AFTER_REFUSAL
    assert {c.tool_use_id for c in calls if c.posted} == {"sevt_w", "sevt_b"}
    if not _SDK_POSTS_AGAIN:
        assert _posted(server, sid)["sevt_w"]["content"] == [
            {"type": "text", "text": "sunny in Oslo"}
        ]
    assert captured.events == []


def test_uninstrument_restores_the_session_runner(
    server: MessagesServer, aclient: anthropic.AsyncAnthropic, captured: InMemoryEventExporter
) -> None:
    from anthropic.lib.tools import _beta_session_runner

    from otel_agentcap.instrumentation.anthropic import tool_runner

    runner_class = getattr(_beta_session_runner, tool_runner.session_runner_class())
    original = runner_class._call_tool
    instrumentor = AnthropicInstrumentor()
    instrumentor.instrument()
    try:
        assert runner_class._call_tool is not original
    finally:
        instrumentor.uninstrument()
    assert runner_class._call_tool is original
    sid = _session(server, CUSTOM_CALLS)
    with ac.run("r-session-plain"), ac.agent("worker"):
        _run(aclient, sid, [weather, forecast])
    assert RUNS == {"weather": 1, "forecast": 1}
    assert not [e for e in captured.events if e.event_type == "tool_invocation"]


@pytest.mark.storage
def test_session_chain_stored_in_postgres(
    server: MessagesServer,
    instrumented: AnthropicInstrumentor,
    stored: Any,
    pg_dsn: str,
) -> None:
    sid = _session(server, CUSTOM_CALLS, refuse_first_post=True)
    client = anthropic.AsyncAnthropic(
        base_url=server.base_url, api_key="sk-ant-test", max_retries=0
    )
    with ac.run("r-pg-session"), ac.agent("worker"):
        _run(client, sid, [weather, forecast])
    # Before anthropic 2.16 the refused post made the runner dispatch both calls again: two
    # attempts each, stored as events of their own, none colliding.
    n = _RUNS_AFTER_REFUSAL
    assert {"weather": n, "forecast": n} == RUNS
    events = stored_events(pg_dsn, "r-pg-session")
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    assert (
        sorted((e["payload"]["invocation_id"], e["payload"].get("attempt", 1)) for e in invocations)
        == _ATTEMPTS_AFTER_REFUSAL
    )
    assert conflict_count(pg_dsn) == 0


class _Lookup(anthropic.lib.tools.BetaAsyncBuiltinFunctionTool):
    """An async builtin tool whose ``call`` is a plain method returning a coroutine: the runner
    awaits what it returns."""

    def to_dict(self) -> Any:
        return {"name": "lookup", "input_schema": {"type": "object"}}

    def call(self, input: object) -> Any:
        return self._lookup(dict(input))  # type: ignore[call-overload]

    async def _lookup(self, arguments: dict[str, Any]) -> str:
        RUNS["lookup"] = RUNS.get("lookup", 0) + 1
        await asyncio.sleep(0)
        if arguments["key"] == "missing":
            raise KeyError("no entry for missing")
        return f"entry for {arguments['key']}"


def test_session_tool_returning_an_awaitable_records_what_it_resolves_to(
    server: MessagesServer,
    aclient: anthropic.AsyncAnthropic,
    captured: InMemoryEventExporter,
    instrumented: AnthropicInstrumentor,
) -> None:
    """A tool whose plain ``call`` returns a coroutine is recorded with the awaited result, and an
    error raised while awaiting it is recorded as agent_error, as the runner sees them."""
    calls = [
        session_event("agent.custom_tool_use", id="sevt_k", name="lookup", input={"key": "a"}),
        session_event(
            "agent.custom_tool_use", id="sevt_m", name="lookup", input={"key": "missing"}
        ),
    ]
    sid = _session(server, calls)
    with ac.run("r-session-awaitable"), ac.agent("worker"):
        _run(aclient, sid, [_Lookup()])
    assert RUNS == {"lookup": 2}
    inputs = {"sevt_k": {"key": "a"}, "sevt_m": {"key": "missing"}}
    events = runner_events(captured, "r-session-awaitable")
    check_session_chain(events, inputs, "no entry for missing")
    [result] = [e for e in events if e["event_type"] == "tool_result"]
    assert result["payload"]["result"] == "entry for a"
