"""Model -> tool -> model chains, one event per call with OpenLLMetry stacked on the SDK, content
opt-in and no API key anywhere: in memory and in the stored PostgreSQL log."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic_support import (
    API_KEY,
    MODEL,
    USER,
    conflict_count,
    expected_tool_use_ids,
    runner_events,
    stored_events,
)
from opentelemetry.sdk.trace import ReadableSpan

import otel_agentcap as ac
from otel_agentcap import jsonsafe
from otel_agentcap.capture.tool_uses import arun_tool_uses, run_tool_uses
from otel_agentcap.pipeline.model_calls import SUPERSEDED, is_content_attribute
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    ToolCall,
    text_reply,
    tool_use_reply,
)

pytestmark = pytest.mark.timeout(120)


@ac.tool
def weather(city: str) -> str:
    return f"sunny in {city}"


@ac.tool
def broken(city: str) -> str:
    raise RuntimeError(f"no data for {city}")


def _script(server: MessagesServer) -> None:
    server.enqueue(
        tool_use_reply(
            [
                ToolCall("weather", {"city": "Oslo"}, id="toolu_w"),
                ToolCall("broken", {"city": "X"}, id="toolu_b"),
            ],
            input_tokens=20,
            output_tokens=9,
        ),
        text_reply("It is sunny in Oslo.", input_tokens=40, output_tokens=6),
    )


def _turn(
    client: anthropic.Anthropic, messages: list[dict[str, object]]
) -> anthropic.types.Message:
    return client.messages.create(model=MODEL, max_tokens=64, messages=messages, tools=[])  # type: ignore[arg-type]


def _chain_one_agent(client: anthropic.Anthropic, run_id: str) -> list[dict[str, object]]:
    with ac.run(run_id), ac.agent("assistant"):
        messages: list[dict[str, object]] = list(USER)
        first = _turn(client, messages)
        results = run_tool_uses(first, [weather, broken])
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": results},
        ]
        _turn(client, messages)
    return results


def _check_chain(events: list[dict[str, object]]) -> None:
    """events: dicts with event_id, agent_id, seq, event_type, parents, payload."""
    by_id = {e["event_id"]: e for e in events}
    calls = [e for e in events if e["event_type"] == "model_call"]
    assert len(calls) == 2
    first, second = sorted(calls, key=lambda e: e["seq"])  # type: ignore[arg-type, return-value]
    assert first["payload"]["tool_use_ids"] == expected_tool_use_ids("toolu_w", "toolu_b")  # type: ignore[index]
    invocations = [e for e in events if e["event_type"] == "tool_invocation"]
    assert {e["payload"]["invocation_id"] for e in invocations} == {"toolu_w", "toolu_b"}  # type: ignore[index]
    for invocation in invocations:
        assert first["event_id"] in invocation["parents"]  # type: ignore[operator]
        assert invocation["seq"] > first["seq"]  # type: ignore[operator]
    # The second call names the result of each tool_use (the error event of the broken one).
    result_parents = [by_id[p] for p in second["parents"]]  # type: ignore[attr-defined]
    assert sorted(p["event_type"] for p in result_parents) == ["agent_error", "tool_result"]
    for parent in result_parents:
        assert second["seq"] > parent["seq"]  # type: ignore[operator]


def test_chain_within_one_agent(server, client, captured, instrumented):
    """model_call -> tool runs (tool_use ids as invocation ids) -> next model_call, in memory."""
    _script(server)
    results = _chain_one_agent(client, "r-chain-1")
    assert results[0] == {
        "type": "tool_result",
        "tool_use_id": "toolu_w",
        "content": "sunny in Oslo",
    }
    assert results[1]["is_error"] is True and "no data for X" in results[1]["content"]
    _check_chain(runner_events(captured, "r-chain-1"))


def test_chain_across_two_agents(server, client, captured, instrumented):
    """A tool run in another agent names the model call; the next call names its result."""
    _script(server)
    with ac.run("r-chain-2"), ac.agent("planner") as planner:
        first = _turn(client, list(USER))
        worker = planner.spawn("worker")
        results = worker.run(run_tool_uses, first, [weather, broken])
        _turn(
            client,
            [
                *USER,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": results},
            ],
        )
    events = runner_events(captured, "r-chain-2")
    _check_chain(events)
    tool_agents = {e["agent_id"] for e in events if e["event_type"] == "tool_invocation"}
    assert tool_agents == {worker.agent_id}


def test_two_agents_answering_one_tool_use_id_each_name_their_own_result(
    server, client, captured, instrumented
):
    """Tool runs are deduplicated per agent, so two agents may each answer the same tool_use id;
    each agent's next model call names its own result, not the one recorded last."""
    for city in ("Oslo", "Rome"):
        server.enqueue(tool_use_reply([ToolCall("weather", {"city": city}, id="toolu_same")]))
    server.enqueue(text_reply("done"), text_reply("done"))
    answered = {}
    with ac.run("r-same-id"):
        for agent_id in ("p", "q"):
            with ac.agent(agent_id):
                reply = _turn(client, list(USER))
                answered[agent_id] = (reply, run_tool_uses(reply, [weather]))
        for agent_id in ("p", "q"):
            reply, results = answered[agent_id]
            with ac.agent(agent_id):
                _turn(
                    client,
                    [
                        *USER,
                        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                        {"role": "user", "content": results},
                    ],
                )
    events = runner_events(captured, "r-same-id")
    by_id = {e["event_id"]: e for e in events}
    for agent_id, city in (("p", "Oslo"), ("q", "Rome")):
        last_call = [
            e for e in events if e["event_type"] == "model_call" and e["agent_id"] == agent_id
        ][-1]
        parents = [by_id[p] for p in last_call["parents"]]
        assert [(p["agent_id"], p["event_type"]) for p in parents] == [(agent_id, "tool_result")]
        assert city in json.dumps(parents[0]["payload"])


def test_async_chain(server, aclient, captured, instrumented):
    """arun_tool_uses and the async client give the same chain."""
    import asyncio

    _script(server)

    async def main() -> None:
        first = await aclient.messages.create(model=MODEL, max_tokens=64, messages=USER)
        results = await arun_tool_uses(first, [weather, broken])
        await aclient.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=[
                *USER,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": results},
            ],
        )

    with ac.run("r-chain-async"), ac.agent("assistant"):
        asyncio.run(main())
    _check_chain(runner_events(captured, "r-chain-async"))


#: messages.parse (structured outputs) is in the SDK releases that have it.
needs_parse = pytest.mark.skipif(
    not hasattr(anthropic.resources.messages.Messages, "parse"),
    reason="the installed anthropic has no messages.parse",
)


@needs_parse
def test_parse_names_the_tool_results_it_sends(server, client, captured, instrumented):
    """messages.parse (structured outputs) sending tool results names them, as create does."""
    _script(server)
    with ac.run("r-chain-parse"), ac.agent("assistant"):
        first = _turn(client, list(USER))
        results = run_tool_uses(first, [weather, broken])
        parsed = client.messages.parse(
            model=MODEL,
            max_tokens=64,
            messages=[
                *USER,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": results},
            ],  # type: ignore[list-item]
        )
    assert isinstance(parsed, anthropic.types.ParsedMessage)
    _check_chain(runner_events(captured, "r-chain-parse"))


@needs_parse
def test_async_beta_parse_names_the_tool_results_it_sends(server, aclient, captured, instrumented):
    """The async client's beta.messages.parse names the tool results it sends too."""
    import asyncio

    _script(server)

    async def main() -> None:
        first = await aclient.messages.create(model=MODEL, max_tokens=64, messages=USER)
        results = await arun_tool_uses(first, [weather, broken])
        await aclient.beta.messages.parse(
            model=MODEL,
            max_tokens=64,
            messages=[
                *USER,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": results},
            ],  # type: ignore[list-item]
        )

    with ac.run("r-chain-beta-parse"), ac.agent("assistant"):
        asyncio.run(main())
    _check_chain(runner_events(captured, "r-chain-beta-parse"))


@pytest.mark.storage
def test_chain_stored_in_postgres(server, client, instrumented, stored, pg_dsn):
    """The model -> tool -> model chain within one agent and across two, in the stored log."""
    _script(server)
    _chain_one_agent(client, "r-pg-chain-1")
    _check_chain(stored_events(pg_dsn, "r-pg-chain-1"))
    _script(server)
    with ac.run("r-pg-chain-2"), ac.agent("planner") as planner:
        first = _turn(client, list(USER))
        results = planner.spawn("worker").run(run_tool_uses, first, [weather, broken])
        _turn(
            client,
            [
                *USER,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": results},
            ],
        )
    _check_chain(stored_events(pg_dsn, "r-pg-chain-2"))
    assert conflict_count(pg_dsn) == 0


# --------------------------------------------------------------------- stacked instrumentations


@pytest.fixture
def openllmetry():
    # In the dev extra, which make test installs; .ci/floors installs the test extra only.
    module = pytest.importorskip(
        "opentelemetry.instrumentation.anthropic", reason="OpenLLMetry (dev extra) not installed"
    )
    instrumentor = module.AnthropicInstrumentor()
    instrumentor.instrument()
    try:
        yield instrumentor
    finally:
        instrumentor.uninstrument()


def _three_calls(client: anthropic.Anthropic, server: MessagesServer, run_id: str) -> None:
    server.enqueue(
        text_reply("plain", input_tokens=10, output_tokens=87),
        text_reply("streamed " * 10, input_tokens=10, output_tokens=87),
        text_reply("helper " * 10, input_tokens=10, output_tokens=87),
    )
    with ac.run(run_id), ac.agent("a"):
        client.messages.create(model=MODEL, max_tokens=64, messages=USER)
        for _ in client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True):
            pass
        with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
            stream.get_final_message()


def test_one_event_per_call_with_openllmetry(server, client, captured, instrumented, openllmetry):
    """With OpenLLMetry stacked on the SDK's tracing each call is one event, tokens not doubled."""
    _three_calls(client, server, "r-stack")
    calls = captured.of_type("model_call")
    assert len(calls) == 3
    assert all(c.payload["usage"]["output_tokens"] == 87 for c in calls)
    assert all(c.payload["instrumentation"] == "com.anthropic.sdk.python" for c in calls)
    superseded = [s for s in captured.spans if (s.attributes or {}).get(SUPERSEDED)]
    assert superseded, "OpenLLMetry's spans are recorded but superseded"
    assert len({c.event_id for c in calls}) == 3


def test_stream_managers_created_before_entering_keep_their_own_stamps(
    server, client, captured, instrumented, openllmetry
):
    """OpenLLMetry opens its span when messages.stream() is called, the SDK when the manager is
    entered: with two managers created first, the SDK's span of one call must not take the stamp
    of the other call's OpenLLMetry span."""
    server.enqueue(
        text_reply("one " * 10, input_tokens=10, output_tokens=11),
        text_reply("two " * 10, input_tokens=20, output_tokens=22),
    )
    with ac.run("r-two-managers"), ac.agent("a"):
        first = client.messages.stream(model=MODEL, max_tokens=64, messages=USER)
        second = client.messages.stream(model=MODEL, max_tokens=64, messages=USER)
        with first as stream:
            one = stream.get_final_message()
        with second as stream:
            two = stream.get_final_message()
    responses_by_event: dict[str, set[str]] = {}
    for span in captured.spans:
        attributes = span.attributes or {}
        event_id, response_id = (
            attributes.get("agentcap.event.id"),
            attributes.get("gen_ai.response.id"),
        )
        if attributes.get("agentcap.event.type") == "model_call" and response_id:
            responses_by_event.setdefault(str(event_id), set()).add(str(response_id))
    assert all(len(responses) == 1 for responses in responses_by_event.values())
    calls = [c for c in captured.of_type("model_call") if c.run_id == "r-two-managers"]
    assert sorted(c.payload["response_id"] for c in calls) == sorted([one.id, two.id])
    assert sorted(c.payload["usage"]["output_tokens"] for c in calls) == [11, 22]


@pytest.mark.storage
def test_one_event_per_call_with_openllmetry_stored(
    server, client, instrumented, openllmetry, stored, pg_dsn
):
    """The stored log holds one model_call row per call and no conflict rows."""
    _three_calls(client, server, "r-pg-stack")
    calls = [e for e in stored_events(pg_dsn, "r-pg-stack") if e["event_type"] == "model_call"]
    assert len(calls) == 3
    assert [c["payload"]["usage"]["output_tokens"] for c in calls] == [87, 87, 87]
    assert conflict_count(pg_dsn) == 0


# ----------------------------------------------------------------------------- content, secrets


def _all_text(spans: list[ReadableSpan], payloads: list[object]) -> str:
    parts: list[str] = []
    for span in spans:
        parts.append(span.name)
        parts.extend(f"{k}={v!r}" for k, v in (span.attributes or {}).items())
        for event in span.events:
            parts.extend(f"{k}={v!r}" for k, v in (event.attributes or {}).items())
        parts.extend(f"{k}={v!r}" for k, v in span.resource.attributes.items())
    parts.extend(jsonsafe.dumps(p) for p in payloads)
    return "\n".join(parts)


def test_content_off_by_default(server, client, captured, instrumented):
    """Without opting in, no span attribute or payload holds the messages or the output."""
    server.enqueue(text_reply("SECRET-OUTPUT-TEXT"))
    with ac.run("r-nocontent"), ac.agent("a"):
        client.messages.create(
            model=MODEL,
            max_tokens=64,
            system="SECRET-SYSTEM-PROMPT",
            messages=[{"role": "user", "content": "SECRET-USER-INPUT"}],
        )
    text = _all_text(captured.spans, [e.payload for e in captured.events])
    for secret in ("SECRET-OUTPUT-TEXT", "SECRET-SYSTEM-PROMPT", "SECRET-USER-INPUT"):
        assert secret not in text
    assert not any(is_content_attribute(k) for s in captured.spans for k in (s.attributes or {}))
    assert "content" not in captured.of_type("model_call")[0].payload


def test_content_when_opted_in_and_no_api_key_anywhere(server, captured, instrumented):
    """In the SDK's content mode the payload has the messages, and the API key is nowhere."""
    server.enqueue(text_reply("visible output"), text_reply("streamed output"))
    cli = anthropic.Anthropic(
        base_url=server.base_url,
        api_key=API_KEY,
        max_retries=0,
        open_telemetry={"traces": {"content_mode": "content"}},
    )
    with ac.run("r-content"), ac.agent("a"):
        cli.messages.create(model=MODEL, max_tokens=64, system="be brief", messages=USER)
        with cli.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
            stream.get_final_message()
    calls = captured.of_type("model_call")
    content = calls[0].payload["content"]
    assert content["input_messages"][0]["role"] == "user"
    assert "visible output" in json.dumps(content["output_messages"])
    assert "system_instructions" in content
    text = _all_text(captured.spans, [e.payload for e in captured.events])
    assert API_KEY not in text
    assert API_KEY[-20:] not in text
    headers = server.requests[0].headers
    sent = headers.get("x-api-key") or headers.get("authorization", "")
    assert API_KEY in sent  # the key was sent, so the scan is meaningful


def test_content_stripped_for_the_collector_kept_in_the_log(server, captured, instrumented):
    """ContentStrippingExporter drops content attributes from what it forwards; the log keeps them."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_agentcap.exporters.strip_content import ContentStrippingExporter
    from otel_agentcap.pipeline.mapping import batch_from_spans

    server.enqueue(text_reply("kept in the log"))
    cli = anthropic.Anthropic(
        base_url=server.base_url,
        api_key=API_KEY,
        max_retries=0,
        open_telemetry={"traces": {"content_mode": "content"}},
    )
    with ac.run("r-strip"), ac.agent("a"):
        cli.messages.create(model=MODEL, max_tokens=64, messages=USER)
    collector = InMemorySpanExporter()
    ContentStrippingExporter(collector).export(captured.spans)
    forwarded = collector.get_finished_spans()
    assert len(forwarded) == len(captured.spans)
    assert not any(is_content_attribute(k) for s in forwarded for k in (s.attributes or {}))
    stripped_call = [e for e in batch_from_spans(forwarded).events if e.event_type == "model_call"]
    assert "content" not in stripped_call[0].payload
    assert "content" in captured.of_type("model_call")[0].payload


def test_strip_payloads_removes_tool_results_from_outcome_records_too(captured):
    """With strip_payloads, tool arguments and results leave no trace in forwarded spans."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_agentcap.exporters.strip_content import ContentStrippingExporter
    from otel_agentcap.pipeline.mapping import batch_from_spans

    @ac.tool
    def secret(x: str) -> str:
        return f"result-{x}-confidential"

    with ac.run("r-strip-payloads"), ac.agent("a"):
        secret.invoke("s1", "input-confidential")
    collector = InMemorySpanExporter()
    ContentStrippingExporter(collector, strip_payloads=True).export(captured.spans)
    forwarded = collector.get_finished_spans()
    text = json.dumps(
        [
            [dict(s.attributes or {}), [dict(e.attributes or {}) for e in s.events]]
            for s in forwarded
        ],
        default=str,
    )
    assert "confidential" not in text
    # The events themselves still come through, only without payloads.
    types = [e.event_type for e in batch_from_spans(forwarded).events]
    assert "tool_invocation" in types and "tool_result" in types


@pytest.mark.parametrize("how", ["create", "stream", "async create"])
def test_a_timed_out_agents_model_call_is_refused_and_nothing_is_recorded_after_its_error(
    server: MessagesServer,
    client: anthropic.Anthropic,
    aclient: anthropic.AsyncAnthropic,
    captured: ac.testing.InMemoryEventExporter,
    instrumented: object,
    how: str,
) -> None:
    """After Agent.run's timeout, a model call from the abandoned worker thread raises
    AgentCancelled before its request is sent, and the log holds nothing of the agent after its
    agent_error."""
    import asyncio
    import threading

    server.enqueue(text_reply("never sent"))
    go_on = threading.Event()
    outcome: list[BaseException] = []

    def body() -> None:
        go_on.wait(10)
        try:
            if how == "create":
                client.messages.create(model=MODEL, max_tokens=16, messages=USER)
            elif how == "stream":
                with client.messages.stream(model=MODEL, max_tokens=16, messages=USER) as stream:
                    stream.get_final_message()
            else:
                asyncio.run(aclient.messages.create(model=MODEL, max_tokens=16, messages=USER))
        except BaseException as error:
            outcome.append(error)
            raise

    agent = None
    with ac.run(f"cancelled-{how}"), ac.agent("boss") as boss:
        agent = boss.spawn("slow")
        with pytest.raises(ac.AgentTimeoutError):
            agent.run(body, timeout=0.2)
        go_on.set()
        deadline = 50
        while not outcome and deadline:
            threading.Event().wait(0.1)
            deadline -= 1
    assert outcome and isinstance(outcome[0], ac.AgentCancelled)
    assert server.requests == []
    events = captured.for_agent(agent.agent_id)
    (error,) = [e for e in events if e.event_type == "agent_error"]
    assert error.payload["timed_out"] is True
    assert [e.event_type for e in events if e.seq > error.seq] == []
    assert not [e for e in events if e.event_type == "model_call"]


def test_a_model_call_span_of_a_cancelled_execution_is_not_stamped(
    captured: ac.testing.InMemoryEventExporter,
) -> None:
    """Without the instrumentor (nothing refuses the call), the processor still records nothing
    for an execution after its agent_error: a model-call span started there is not stamped."""
    from opentelemetry import trace

    from otel_agentcap.context import bind_agent, reset_agent

    tracer = trace.get_tracer("test")
    with ac.run("cancelled-span"):
        scope = ac.agent("worker")
        with pytest.raises(RuntimeError), scope as execution:
            raise RuntimeError("failed")
        token = bind_agent(execution.context)
        try:
            tracer.start_span("chat m", attributes={"gen_ai.operation.name": "chat"}).end()
        finally:
            reset_agent(token)
    (span,) = [s for s in captured.spans if s.name == "chat m"]
    assert "agentcap.event.id" not in (span.attributes or {})
    assert [e.event_type for e in captured.events] == ["agent_start", "agent_error"]
