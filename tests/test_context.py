"""Agent context in ContextVars: propagation across asyncio and threads, isolation, caused_by,
and id validation."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import otel_agentcap as oa
from otel_agentcap.context import (
    ambient_causal_parents,
    current_agent,
    current_run,
    new_agent_context,
)
from otel_agentcap.model import EventRef, validate_id


def _run_id() -> str:
    return f"ctx-{uuid.uuid4().hex[:12]}"


def _agent_id() -> str | None:
    ctx = current_agent()
    return None if ctx is None else ctx.agent_id


def test_outside_everything_no_agent_or_run():
    """Outside any scope there is neither a current agent nor a current run."""
    assert current_agent() is None
    assert current_run() is None


def test_agent_scope_binds_and_unbinds():
    """Inside an agent scope the agent and its run are current; after it they are gone."""
    run_id = _run_id()
    with oa.run(run_id), oa.agent("alpha"):
        assert _agent_id() == "alpha"
        assert current_run().run_id == run_id
    assert current_agent() is None
    assert current_run() is None


def test_context_survives_gather_and_create_task():
    """Coroutines in asyncio.gather and tasks from create_task see the creating agent."""

    async def probe() -> str | None:
        await asyncio.sleep(0)
        return _agent_id()

    async def main() -> tuple[list[str | None], str | None]:
        async with oa.agent("alpha"):
            gathered = await asyncio.gather(probe(), probe(), probe())
            task = asyncio.create_task(probe())
            return list(gathered), await task

    with oa.run(_run_id()):
        gathered, from_task = asyncio.run(main())
    assert gathered == ["alpha"] * 3
    assert from_task == "alpha"


def test_context_survives_to_thread():
    """asyncio.to_thread runs the function with the caller's agent."""

    async def main() -> str | None:
        async with oa.agent("alpha"):
            return await asyncio.to_thread(_agent_id)

    with oa.run(_run_id()):
        assert asyncio.run(main()) == "alpha"


def test_wrap_carries_context_into_plain_thread():
    """A function passed through wrap() sees the agent in a thread started later."""
    seen: list[str | None] = []
    with oa.run(_run_id()), oa.agent("alpha"):
        fn = oa.wrap(lambda: seen.append(_agent_id()))
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()
    assert seen == ["alpha"]


def test_plain_thread_does_not_carry_context():
    """A plain threading.Thread starts without the agent (which is why wrap exists)."""
    seen: list[str | None] = []
    with oa.run(_run_id()), oa.agent("alpha"):
        thread = threading.Thread(target=lambda: seen.append(_agent_id()))
        thread.start()
        thread.join()
    assert seen == [None]


def test_start_thread_carries_context():
    """start_thread runs its target with the starting agent and arguments."""
    seen: list[tuple[str | None, int]] = []
    with oa.run(_run_id()), oa.agent("alpha"):
        thread = oa.start_thread(lambda x: seen.append((_agent_id(), x)), 7)
        thread.join()
    assert seen == [("alpha", 7)]


def test_plain_executor_submit_does_not_carry_context():
    """ThreadPoolExecutor.submit runs without the agent."""
    with oa.run(_run_id()), oa.agent("alpha"), ThreadPoolExecutor(2) as pool:
        assert pool.submit(_agent_id).result() is None


def test_context_executor_carries_context_of_each_submitter():
    """ContextThreadPoolExecutor.submit runs each call with its submitter's agent."""
    with oa.ContextThreadPoolExecutor(2) as pool, oa.run(_run_id()):
        with oa.agent("alpha"):
            a = pool.submit(_agent_id)
        with oa.agent("beta"):
            b = pool.submit(_agent_id)
        assert (a.result(), b.result()) == ("alpha", "beta")


def test_context_does_not_leak_between_concurrent_async_agents():
    """Fifty concurrent tasks, each in its own agent, see only their own agent across awaits."""

    async def worker(i: int) -> list[str | None]:
        seen = []
        async with oa.agent(f"agent-{i}"):
            for _ in range(5):
                await asyncio.sleep(0.001 * (i % 3))
                seen.append(_agent_id())
        seen.append(_agent_id())
        return seen

    async def main() -> list[list[str | None]]:
        return await asyncio.gather(*(worker(i) for i in range(50)))

    with oa.run(_run_id()):
        results = asyncio.run(main())
    for i, seen in enumerate(results):
        assert seen == [f"agent-{i}"] * 5 + [None]


def test_context_does_not_leak_between_threads():
    """Threads each entering their own agent never observe another thread's agent."""
    barrier = threading.Barrier(16)
    bad: list[tuple[int, str | None]] = []

    def worker(i: int) -> None:
        with oa.agent(f"agent-{i}"):
            barrier.wait()
            for _ in range(200):
                got = _agent_id()
                if got != f"agent-{i}":
                    bad.append((i, got))

    with oa.run(_run_id()):
        threads = [oa.start_thread(worker, i) for i in range(16)]
        for t in threads:
            t.join()
    assert bad == []


def test_nested_agent_restores_outer():
    """A nested agent scope replaces the current agent and restores the outer one on exit."""
    with oa.run(_run_id()), oa.agent("outer"):
        with oa.agent("inner"):
            assert _agent_id() == "inner"
        assert _agent_id() == "outer"


def test_caused_by_nests_and_resets():
    """caused_by adds parents for its block, nests additively and restores on exit (also on error)."""
    a = EventRef("a", 1)
    b = EventRef("b", 2)
    assert ambient_causal_parents() == ()
    with oa.caused_by(a):
        assert ambient_causal_parents() == (a,)
        with oa.caused_by(b):
            assert ambient_causal_parents() == (a, b)
        assert ambient_causal_parents() == (a,)
        with pytest.raises(KeyError), oa.caused_by(b):
            raise KeyError("x")
        assert ambient_causal_parents() == (a,)
    assert ambient_causal_parents() == ()


def test_caused_by_rejects_non_refs():
    """caused_by with something that is not an EventRef raises TypeError."""
    with pytest.raises(TypeError), oa.caused_by("event-id"):  # type: ignore[arg-type]
        pass


def test_caused_by_parents_become_causal_parents_with_larger_seq():
    """An event captured inside caused_by names the parent and has a sequence above it."""
    from otel_agentcap.testing import capture_events

    parent = EventRef("00000000-0000-0000-0000-000000000001", 500, "elsewhere")
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        with oa.caused_by(parent):
            memory["k"] = 1
        memory["k"] = 2
    writes = captured.of_type("memory_write")
    assert parent.event_id in writes[0].causal_parent_ids
    assert writes[0].seq > 500
    assert parent.event_id not in writes[1].causal_parent_ids


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("", ValueError),
        ("   ", ValueError),
        ("a\x00b", ValueError),
        ("x" * 513, ValueError),
        ("\u65e5" * 171, ValueError),  # 171 characters, 513 bytes
        ("bad\ud800", ValueError),
        (42, TypeError),
        (None, TypeError),
        (b"bytes", TypeError),
    ],
)
def test_invalid_ids_raise_at_the_call(bad, error):
    """Bad ids raise ValueError or TypeError from validate_id, run, agent and the agent context."""
    with pytest.raises(error):
        validate_id(bad, "id")
    if bad is not None:
        with pytest.raises(error), oa.run(bad):
            pass
        with pytest.raises(error):
            oa.agent(bad)
        with pytest.raises(error):
            oa.agent("ok", agent_id=bad)
        with pytest.raises(error):
            new_agent_context("run", bad, "name")
        with pytest.raises(error):
            new_agent_context(bad, "agent", "name")


def test_valid_ids_accepted():
    """Ids up to 512 bytes, with spaces and non-ASCII text, are accepted as given."""
    for good in [
        "a",
        "x" * 512,
        "\U0001d538" * 128,
        "run 1",
        "agent/worker-3",
        "\u00e9t\u00e9",
        "\u65e5\u672c",
    ]:
        assert validate_id(good, "id") == good


def test_a_str_subclass_id_is_used_as_its_characters():
    """A str subclass whose __str__ raises is accepted as the plain str of its characters."""

    class Weird(str):
        def __str__(self) -> str:
            raise ZeroDivisionError

        def __format__(self, spec: str) -> str:
            raise ZeroDivisionError

    checked = validate_id(Weird("run-1"), "id")
    assert type(checked) is str and checked == "run-1"
    with oa.run(Weird("run-weird")) as run, oa.agent(Weird("planner")) as execution:
        assert type(run.run_id) is str and type(execution.agent_id) is str
