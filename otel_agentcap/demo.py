"""The demo program: a planner that spawns researcher agents across threads and asyncio tasks.

Researchers run captured tools and write findings to shared memory; one tool fails (recorded and
handled), one agent times out (recorded and rolled back), and a writer agent reads every finding.
It records through whatever TracerProvider is configured; ``otel-agentcap demo`` configures the
PostgreSQL event log first.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import otel_agentcap as ac

TOPICS = ("lamport clocks", "idempotency keys", "write-ahead logs", "span links")


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


def research(topic: str) -> None:
    """A researcher in a worker thread."""
    execution = ac.current_execution()
    assert execution is not None
    snippets = search.invoke(f"search:{topic}", topic, depth=2)
    # An application-level retry of the same invocation: returns the recorded result.
    assert search.invoke(f"search:{topic}", topic, depth=2) == snippets
    execution.state["snippets"] = snippets
    memory[f"finding:{topic}"] = summarize(snippets)


async def research_async(topic: str) -> None:
    """A researcher as an asyncio task."""
    snippets = await asearch.invoke(f"asearch:{topic}", topic)
    try:
        fetch_paywalled(f"https://example.invalid/{topic}")
    except PermissionError:
        snippets.append("paywalled source skipped")
    memory[f"finding:{topic}"] = summarize(snippets)


def stuck_researcher() -> None:
    """Waits for a source that never comes; its agent times out."""
    execution = ac.current_execution()
    assert execution is not None
    execution.state["half_done"] = True
    time.sleep(0.5)
    memory["finding:never"] = "must not be written"  # raises AgentCancelled: the agent timed out


def write_report(topics: list[str]) -> str:
    lines = []
    for topic in topics:
        found = memory.lookup(f"finding:{topic}")
        lines.append(f"- {topic}: {found.value if found.found else '(missing)'}")
    report = "\n".join(lines)
    memory["report"] = report
    return report


async def _async_researchers(planner: ac.AgentExecution, topics: list[str]) -> None:
    async def one(topic: str) -> None:
        child = planner.spawn("researcher", key=f"researcher:{topic}")
        await child.arun(research_async, topic, timeout=5)

    await asyncio.gather(*(one(topic) for topic in topics))


def run_demo(run_id: str | None = None) -> DemoResult:
    """Run the demo once; returns what happened. Safe to call again with the same run id."""
    thread_topics = list(TOPICS[:2])
    async_topics = list(TOPICS[2:])
    with ac.run(run_id) as run:
        result = DemoResult(run.run_id)
        with ac.agent("planner") as planner:
            memory["plan"] = thread_topics + async_topics
            workers = {
                topic: planner.spawn("researcher", key=f"researcher:{topic}")
                for topic in thread_topics
            }
            with ac.ContextThreadPoolExecutor(max_workers=2) as pool:
                futures = [
                    pool.submit(workers[t].run, research, t, timeout=5) for t in thread_topics
                ]
                for future in futures:
                    future.result()
            asyncio.run(_async_researchers(planner, async_topics))
            result.failed_tools = len(async_topics)
            slow = planner.spawn("researcher", key="researcher:slow")
            try:
                slow.run(stuck_researcher, timeout=0.1)
            except ac.AgentTimeoutError:
                result.timed_out_agents.append(slow.agent_id)
            writer = planner.spawn("writer")
            result.report = writer.run(write_report, thread_topics + async_topics)
            for topic in thread_topics + async_topics:
                result.findings[topic] = str(memory.get(f"finding:{topic}"))
        # Give the stuck thread time to hit its cancellation, so its attempt is on record too.
        time.sleep(0.5)
    return result
