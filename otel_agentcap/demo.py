"""The demo program: a multi-agent research workflow that calls a model.

A planner asks the model for a plan and spawns researcher agents, in worker threads and as asyncio
tasks. Each researcher calls the model, runs the ``tool_use`` blocks of its answer through captured
tools (:func:`otel_agentcap.run_tool_uses`), sends the results back and writes the model's finding
to shared memory. One tool fails (recorded, and sent back as an ``is_error`` tool_result), one
researcher times out (recorded and rolled back), and a writer agent reads every finding and streams
the final answer.

The run is one trace: its root span ``invoke_workflow {run id}``, the planner under it, each
researcher and the writer under the ``create_agent`` span that spawned them, and a link from every
span to the spans of its causal parents (``otel-agentcap export RUN_ID --format jaeger-json``
writes it for the Jaeger UI).

By default the model is a local :class:`~otel_agentcap.testing.messages_server.MessagesServer`
started by the demo (real HTTP, no network); with ``live=True`` and ``ANTHROPIC_API_KEY`` set it
calls the real API. It records through whatever TracerProvider is configured (``otel-agentcap
demo`` configures the PostgreSQL event log first) and instruments the anthropic SDK for causal
links if nobody did.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import otel_agentcap as ac

TOPICS = ("lamport clocks", "idempotency keys", "write-ahead logs", "span links")
MODEL = "claude-sonnet-4-5"
LIVE_MODEL = os.environ.get("AGENTCAP_DEMO_MODEL", "claude-sonnet-4-5")

PLANNER_SYSTEM = "You are the planner. Reply with one research topic per line, nothing else."
RESEARCHER_SYSTEM = "You are a researcher. Use the tools, then answer with one short finding."
WRITER_SYSTEM = "You are the writer. Turn the findings into a short report."


@dataclass
class DemoResult:
    run_id: str
    findings: dict[str, str] = field(default_factory=dict)
    failed_tools: int = 0
    timed_out_agents: list[str] = field(default_factory=list)
    report: str = ""


memory = ac.Memory("demo")


@ac.tool
def search(topic: str, depth: int = 1) -> list[str]:
    """Pretend to search; deterministic given the topic."""
    time.sleep(0.002)
    rng = random.Random(topic)
    return [f"{topic}: source {rng.randint(100, 999)}" for _ in range(depth + 1)]


@ac.tool
def summarize(snippets: list[str]) -> str:
    return "; ".join(sorted(snippets))[:200]


@ac.tool
def fetch_paywalled(url: str) -> str:
    raise PermissionError(f"402 payment required: {url}")


@ac.tool
async def asearch(topic: str) -> list[str]:
    await asyncio.sleep(0.002)
    return [f"{topic}: async source"]


TOOL_DEFINITIONS: list[dict[str, Any]] = [
    {
        "name": "search",
        "description": "Search sources about a topic.",
        "input_schema": {
            "type": "object",
            "properties": {"topic": {"type": "string"}, "depth": {"type": "integer"}},
            "required": ["topic"],
        },
    },
    {
        "name": "asearch",
        "description": "Search sources about a topic (async backend).",
        "input_schema": {
            "type": "object",
            "properties": {"topic": {"type": "string"}},
            "required": ["topic"],
        },
    },
    {
        "name": "fetch_paywalled",
        "description": "Fetch a document by URL.",
        "input_schema": {
            "type": "object",
            "properties": {"url": {"type": "string"}},
            "required": ["url"],
        },
    },
]


# --------------------------------------------------------------------------- the scripted model


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if isinstance(block, dict):
            if block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            elif block.get("type") == "tool_result":
                parts.append(str(block.get("content", "")))
    return " ".join(parts)


def _respond(body: dict[str, Any]) -> Any:
    """The local model: answers planner, researcher and writer requests like a cooperative LLM."""
    from otel_agentcap.testing.messages_server import text_reply, tool_use_reply

    system = str(body.get("system", ""))
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    prompt = _text_of(last.get("content"))
    if system == PLANNER_SYSTEM:
        return text_reply("\n".join(TOPICS), input_tokens=40, output_tokens=16, cache_read=32)
    if system == WRITER_SYSTEM:
        return text_reply(
            "Report. " + prompt[:300], input_tokens=120, output_tokens=60, text_chunks=12
        )
    if isinstance(last.get("content"), list):  # tool results came back
        return text_reply(f"Finding: {prompt[:160]}", input_tokens=90, output_tokens=30)
    topic = prompt.removeprefix("Research: ").strip()
    if topic.startswith(("write-ahead", "span")):
        calls: list[tuple[str, dict[str, Any]]] = [
            ("asearch", {"topic": topic}),
            ("fetch_paywalled", {"url": f"https://example.invalid/{topic.replace(' ', '-')}"}),
        ]
    else:
        calls = [("search", {"topic": topic, "depth": 2})]
    return tool_use_reply(calls, input_tokens=60, output_tokens=25)


# --------------------------------------------------------------------------- agents


def _ask(client: Any, system: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.messages.create(
        model=_model(client), max_tokens=512, system=system, messages=messages, **extra
    )


def _model(client: Any) -> str:
    return str(getattr(client, "_agentcap_demo_model", MODEL))


def _final_text(message: Any) -> str:
    return "".join(getattr(block, "text", "") for block in message.content).strip()


def research(client: Any, topic: str) -> None:
    """A researcher in a worker thread: model -> tools -> model, finding to memory."""
    execution = ac.current_execution()
    assert execution is not None
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Research: {topic}"}]
    first = _ask(client, RESEARCHER_SYSTEM, messages, tools=TOOL_DEFINITIONS)
    results = ac.run_tool_uses(first, [search, summarize, fetch_paywalled])
    # An application-level retry of the same tool_use returns the recorded result.
    assert ac.run_tool_uses(first, [search, summarize, fetch_paywalled]) == results
    execution.state["tool_results"] = len(results)
    if results:
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": results},
        ]
        answer = _ask(client, RESEARCHER_SYSTEM, messages, tools=TOOL_DEFINITIONS)
    else:
        answer = first
    memory[f"finding:{topic}"] = _final_text(answer)


async def research_async(aclient: Any, topic: str) -> int:
    """A researcher as an asyncio task; returns how many of its tools failed."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Research: {topic}"}]
    first = await aclient.messages.create(
        model=_model(aclient),
        max_tokens=512,
        system=RESEARCHER_SYSTEM,
        messages=messages,
        tools=TOOL_DEFINITIONS,
    )
    results = await ac.arun_tool_uses(first, [asearch, fetch_paywalled, search])
    failed = sum(1 for r in results if r.get("is_error"))
    if results:
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": results},
        ]
        first = await aclient.messages.create(
            model=_model(aclient), max_tokens=512, system=RESEARCHER_SYSTEM, messages=messages
        )
    memory[f"finding:{topic}"] = _final_text(first)
    return failed


def stuck_researcher() -> None:
    """Waits for a source that never comes; its agent times out."""
    execution = ac.current_execution()
    assert execution is not None
    execution.state["half_done"] = True
    time.sleep(0.5)
    memory["finding:never"] = "must not be written"  # raises AgentCancelled: the agent timed out


def write_report(client: Any, topics: list[str]) -> str:
    """The writer: reads every finding and streams the final answer."""
    lines = []
    for topic in topics:
        found = memory.lookup(f"finding:{topic}")
        lines.append(f"- {topic}: {found.value if found.found else '(missing)'}")
    with client.messages.stream(
        model=_model(client),
        max_tokens=512,
        system=WRITER_SYSTEM,
        messages=[{"role": "user", "content": "\n".join(lines)}],
    ) as stream:
        report = "".join(stream.text_stream)
    memory["report"] = report
    return report


def _plan(client: Any) -> list[str]:
    answer = _ask(client, PLANNER_SYSTEM, [{"role": "user", "content": "Plan the research."}])
    topics = [line.strip("-* ").strip() for line in _final_text(answer).splitlines()]
    topics = [t for t in topics if t][: len(TOPICS)]
    return topics if len(topics) >= 2 else list(TOPICS)


async def _async_researchers(planner: ac.AgentExecution, aclient: Any, topics: list[str]) -> int:
    async def one(topic: str) -> int:
        child = planner.spawn("researcher", key=f"researcher:{topic}")
        return await child.arun(research_async, aclient, topic, timeout=30)

    return sum(await asyncio.gather(*(one(topic) for topic in topics)))


def _clients(stack: ExitStack, live: bool) -> tuple[Any, Any]:
    import anthropic

    if live:
        if not os.environ.get("ANTHROPIC_API_KEY"):
            raise RuntimeError("--live needs ANTHROPIC_API_KEY")
        client = anthropic.Anthropic()
        aclient = anthropic.AsyncAnthropic()
        model = LIVE_MODEL
    else:
        from otel_agentcap.testing.messages_server import MessagesServer

        server = stack.enter_context(MessagesServer(default_reply=_respond))
        client = anthropic.Anthropic(base_url=server.base_url, api_key="demo-key", max_retries=0)
        aclient = anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="demo-key", max_retries=0
        )
        model = MODEL
    for cli in (client, aclient):
        setattr(cli, "_agentcap_demo_model", model)  # noqa: B010
    stack.callback(client.close)
    return client, aclient


def _instrument(stack: ExitStack) -> None:
    from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor

    instrumentor = AnthropicInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()
        stack.callback(instrumentor.uninstrument)


def run_demo(run_id: str | None = None, *, live: bool = False) -> DemoResult:
    """Run the demo once, as a new run (``run_id``, default a generated one); returns what
    happened. A ``run_id`` the log (or this process) holds already raises ``RunExistsError``."""
    with ExitStack() as stack:
        _instrument(stack)
        client, aclient = _clients(stack, live)
        with ac.run(run_id) as run:
            result = DemoResult(run.run_id)
            with ac.agent("planner") as planner:
                topics = _plan(client)
                memory["plan"] = topics
                thread_topics, async_topics = topics[:2], topics[2:]
                workers = {
                    topic: planner.spawn("researcher", key=f"researcher:{topic}")
                    for topic in thread_topics
                }
                with ac.ContextThreadPoolExecutor(max_workers=2) as pool:
                    futures = [
                        pool.submit(workers[t].run, research, client, t, timeout=30)
                        for t in thread_topics
                    ]
                    for future in futures:
                        future.result()
                result.failed_tools = asyncio.run(
                    _async_researchers(planner, aclient, async_topics)
                )
                slow = planner.spawn("researcher", key="researcher:slow")
                try:
                    slow.run(stuck_researcher, timeout=0.1)
                except ac.AgentTimeoutError:
                    result.timed_out_agents.append(slow.agent_id)
                writer = planner.spawn("writer")
                result.report = writer.run(write_report, client, topics)
                for topic in topics:
                    result.findings[topic] = str(memory.get(f"finding:{topic}"))
            # Give the stuck thread time to hit its cancellation, so its attempt is on record.
            time.sleep(0.5)
    return result


if __name__ == "__main__":  # pragma: no cover
    outcome = run_demo()
    print(json.dumps({"run_id": outcome.run_id, "report": outcome.report}, indent=2))
