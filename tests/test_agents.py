"""Agents: spawns, state isolation and rollback, timeouts, the span processor and event ids."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import math
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.model import EVENT_NAMESPACE, event_id_for
from otel_agentcap.testing import capture_events


def _run_id() -> str:
    return f"agents-{uuid.uuid4().hex[:12]}"


def _root(name: str) -> oa.Agent:
    return oa.agent(name).agent


# Spawns


def test_retried_spawn_returns_same_child_and_records_once():
    """Spawning again with the same key returns the same child and records one agent_spawn."""
    with capture_events() as captured, oa.run(_run_id()), oa.agent("parent") as parent:
        first = parent.spawn("worker", key="job-1")
        second = parent.spawn("worker", key="job-1")
        third = oa.spawn("worker", key="job-1")
    assert first is second is third
    assert len(captured.of_type("agent_spawn")) == 1


def test_spawn_without_key_twice_returns_same_child():
    """Two spawns with the same name and no key give one child (the name is the key)."""
    with capture_events() as captured, oa.run(_run_id()), oa.agent("parent"):
        a = oa.spawn("worker")
        b = oa.spawn("worker")
    assert a is b
    assert a.agent_id == "parent/worker"
    assert len(captured.of_type("agent_spawn")) == 1


def test_distinct_keys_give_distinct_children():
    """Spawns with distinct keys create distinct children, each recorded once."""
    with capture_events() as captured, oa.run(_run_id()), oa.agent("parent"):
        children = [oa.spawn("worker", key=f"k{i}") for i in range(5)]
    assert len({c.agent_id for c in children}) == 5
    spawns = captured.of_type("agent_spawn")
    assert sorted(e.payload["child_agent_id"] for e in spawns) == sorted(
        c.agent_id for c in children
    )


def test_concurrent_spawns_of_one_identity_give_one_child():
    """Sixteen threads spawning the same key concurrently all get one child and one event."""
    barrier = threading.Barrier(16)
    children: list[oa.Agent] = []

    def spawner() -> None:
        barrier.wait()
        children.append(oa.spawn("worker", key="same"))

    with capture_events() as captured, oa.run(_run_id()), oa.agent("parent"):
        threads = [oa.start_thread(spawner) for _ in range(16)]
        for t in threads:
            t.join()
    assert len({id(c) for c in children}) == 1
    assert len(captured.of_type("agent_spawn")) == 1


def test_child_invoke_span_is_a_child_of_and_links_to_its_spawn_span():
    """The child's invoke_agent span is a child of the parent's create_agent span and links to
    it (the spawn is its causal parent), with the spawn event's id on the link."""
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("parent"):
            child = oa.spawn("worker")
        with child.scope():
            pass
    create = next(s for s in captured.spans if s.name == "create_agent parent/worker")
    invoke = next(s for s in captured.spans if s.name == "invoke_agent parent/worker")
    assert create.attributes[attr.GEN_AI_OPERATION_NAME] == "create_agent"
    assert invoke.attributes[attr.GEN_AI_OPERATION_NAME] == "invoke_agent"
    assert invoke.parent is not None and invoke.parent.span_id == create.context.span_id
    assert [link.context.span_id for link in invoke.links] == [create.context.span_id]
    assert invoke.links[0].context.trace_id == create.context.trace_id
    assert invoke.links[0].attributes[attr.LINK_EVENT_ID] == create.attributes[attr.EVENT_ID]


def test_a_top_level_agent_entered_in_a_thread_without_the_run_context_is_in_the_run_trace():
    """A top-level agent of a run entered in a plain thread (a context with no run and no span,
    as in a worker thread started before the run) runs under the run's root span."""
    with capture_events() as captured, oa.run(_run_id()):
        scope = oa.agent("loner")
        agent = oa.agent("other").agent
        thread = threading.Thread(
            target=lambda: (scope.__enter__(), scope.__exit__(None, None, None))
        )
        thread.start()
        thread.join()
        thread = threading.Thread(target=agent.run, args=(lambda: None,))
        thread.start()
        thread.join()
    (root,) = [s for s in captured.spans if s.name.startswith("invoke_workflow ")]
    for name in ("invoke_agent loner", "invoke_agent other"):
        (span,) = [s for s in captured.spans if s.name == name]
        assert span.context.trace_id == root.context.trace_id, name
        assert span.parent is not None and span.parent.span_id == root.context.span_id, name


def test_child_start_records_where_it_was_spawned():
    """The child's agent_start carries its parent and spawn event, as attributes, parent and agent row."""
    run_id = _run_id()
    with capture_events() as captured, oa.run(run_id):
        with oa.agent("parent"):
            child = oa.spawn("worker", key="w1")
        with child.scope():
            pass
    spawn_event = captured.of_type("agent_spawn")[0]
    start = next(e for e in captured.of_type("agent_start") if e.agent_id == child.agent_id)
    assert start.causal_parent_ids == (spawn_event.event_id,)
    invoke = next(s for s in captured.spans if s.name == "invoke_agent parent/w1")
    assert invoke.attributes[attr.SPAWNED_AT_EVENT_ID] == spawn_event.event_id
    assert invoke.attributes[attr.PARENT_AGENT_ID] == "parent"
    record = captured.agents[(run_id, child.agent_id)]
    assert record.parent_agent_id == "parent"
    assert record.spawned_at_event_id == spawn_event.event_id
    assert record.name == "worker"


def test_child_first_seq_above_spawn_in_another_thread():
    """A child run in a plain thread (no copied context) starts above the spawn's sequence."""
    memory = oa.Memory()
    seen: dict[str, int] = {}

    def child_body() -> None:
        with child.scope():
            memory["from-child"] = 1

    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("parent"):
            for i in range(100):
                memory[f"k{i}"] = i
            child = oa.spawn("worker")
        thread = threading.Thread(target=child_body)
        thread.start()
        thread.join()
    spawn_seq = captured.of_type("agent_spawn")[0].seq
    child_events = captured.for_agent(child.agent_id)
    seen["min"] = min(e.seq for e in child_events)
    assert spawn_seq > 100
    assert seen["min"] > spawn_seq
    assert [e.event_type for e in child_events] == ["agent_start", "memory_write", "agent_end"]


def test_spawn_same_id_under_other_parent_conflicts():
    """Spawning an agent id that already belongs to another parent raises SpawnConflictError."""
    with oa.run(_run_id()):
        with oa.agent("p1"):
            oa.spawn("w", agent_id="shared-child")
        with oa.agent("p2"), pytest.raises(oa.SpawnConflictError):
            oa.spawn("w", agent_id="shared-child")
        with oa.agent("p3"), pytest.raises(oa.SpawnConflictError):
            oa.spawn("w", agent_id="p1")  # a root agent has no parent


def test_spawn_outside_agent_raises():
    """spawn() with no current agent raises RuntimeError."""
    with oa.run(_run_id()), pytest.raises(RuntimeError):
        oa.spawn("w")


# State


def test_each_execution_gets_its_own_state_copy():
    """Two concurrent executions of one agent do not see each other's state changes."""
    agent = _root("stateful")
    barrier = threading.Barrier(2)
    seen: dict[int, dict[str, object]] = {}

    def execution(i: int) -> None:
        with agent.scope() as ex:
            ex.state["mine"] = i
            ex.state.setdefault("list", []).append(i)
            barrier.wait()
            time.sleep(0.05)
            seen[i] = dict(ex.state)

    with oa.run(agent.run_id):
        with agent.scope() as ex:
            ex.state["list"] = [0]
        threads = [threading.Thread(target=execution, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert seen[1] == {"mine": 1, "list": [0, 1]}
    assert seen[2] == {"mine": 2, "list": [0, 2]}


def test_success_commits_state_and_agent_state_is_a_copy():
    """A successful execution commits its state; agent.state returns a copy, not the committed dict."""
    agent = _root("committer")
    with agent.scope() as ex:
        ex.state["plan"] = ["a"]
    assert agent.state == {"plan": ["a"]}
    agent.state["plan"].append("mutated")
    assert agent.state == {"plan": ["a"]}
    with agent.scope() as ex:
        assert ex.state == {"plan": ["a"]}


def test_failing_execution_records_error_and_rolls_back():
    """A failing execution records agent_error with the error type and leaves agent.state unchanged."""
    agent = _root("failer")
    with capture_events() as captured:
        with agent.scope() as ex:
            ex.state["keep"] = 1
        with pytest.raises(KeyError), agent.scope() as ex:
            ex.state["keep"] = 99
            ex.state["partial"] = True
            raise KeyError("boom")
    assert agent.state == {"keep": 1}
    errors = captured.of_type("agent_error")
    assert len(errors) == 1
    assert errors[0].payload["error_type"] == "KeyError"
    assert errors[0].payload["timed_out"] is False
    assert errors[0].payload["state_rolled_back"] is True
    assert errors[0].payload["discarded_state_keys"] == ["keep", "partial"]
    span = next(
        s
        for s in captured.spans
        if '"type":"agent_error"' in str((s.attributes or {}).get(attr.OUTCOME, ""))
    )
    assert span.name == "invoke_agent failer"
    assert span.status.status_code == trace.StatusCode.ERROR


def test_async_scope_timeout_records_and_rolls_back():
    """async with agent(timeout=) cancels the body, records agent_error timed_out and rolls back."""

    async def main(name: str) -> None:
        async with oa.agent(name) as ex:
            ex.state["v"] = 1
        async with oa.agent(name, timeout=0.05) as ex:
            ex.state["v"] = 2
            await asyncio.sleep(5)

    name = f"async-{uuid.uuid4().hex[:6]}"
    with capture_events() as captured, oa.run(_run_id()):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            asyncio.run(main(name))
        assert time.monotonic() - started < 2
        agent = oa.agent(name).agent
    assert agent.state == {"v": 1}
    errors = captured.of_type("agent_error")
    assert len(errors) == 1 and errors[0].payload["timed_out"] is True


def test_arun_timeout_records_and_rolls_back():
    """Agent.arun(timeout=) raises TimeoutError, records agent_error timed_out and rolls back."""
    agent = _root("arun-agent")

    async def body() -> None:
        execution = oa.current_execution()
        execution.state["partial"] = 1
        await asyncio.sleep(5)

    async def ok() -> int:
        oa.current_execution().state["done"] = 1
        return 3

    with capture_events() as captured:
        assert asyncio.run(agent.arun(ok, timeout=1)) == 3
        with pytest.raises(TimeoutError):
            asyncio.run(agent.arun(body, timeout=0.05))
    assert agent.state == {"done": 1}
    errors = captured.of_type("agent_error")
    assert len(errors) == 1 and errors[0].payload["timed_out"] is True
    assert errors[0].payload["discarded_state_keys"] == ["done", "partial"]


def test_sync_run_timeout_raises_promptly_and_cancels_stuck_thread():
    """run(fn, timeout=) raises AgentTimeoutError promptly, records, rolls back, and the stuck
    thread's next capture call raises AgentCancelled."""
    agent = _root("blocker")
    release = threading.Event()
    after_release: list[BaseException | None] = []
    finished = threading.Event()
    memory = oa.Memory()

    def body() -> None:
        oa.current_execution().state["partial"] = True
        release.wait(10)
        try:
            memory["late"] = 1
            after_release.append(None)
        except BaseException as exc:
            after_release.append(exc)
            raise
        finally:
            finished.set()

    with capture_events() as captured:
        started = time.monotonic()
        with pytest.raises(oa.AgentTimeoutError):
            agent.run(body, timeout=0.1)
        elapsed = time.monotonic() - started
        assert agent.state == {}
        errors = captured.of_type("agent_error")
        assert len(errors) == 1 and errors[0].payload["timed_out"] is True
        release.set()
        assert finished.wait(5)
    assert elapsed < 5.0  # the body waits 10 s unless the timeout returns first
    assert len(after_release) == 1 and isinstance(after_release[0], oa.AgentCancelled)
    assert "late" not in memory.snapshot()
    assert agent.state == {}
    assert len(captured.of_type("agent_error")) == 1
    assert captured.of_type("agent_end") == []


def test_sync_run_without_timeout_returns_and_propagates():
    """run(fn) returns fn's result and run(fn, timeout=) re-raises fn's own error."""
    agent = _root("plain-run")
    assert agent.run(lambda x: x + 1, 1) == 2
    assert agent.run(lambda: "t", timeout=5) == "t"
    with pytest.raises(ZeroDivisionError):
        agent.run(lambda: 1 / 0, timeout=5)


def test_sync_scope_overrunning_timeout_fails():
    """A sync scope whose block finishes after its timeout raises AgentTimeoutError and rolls back."""
    agent = _root("slow-scope")
    with pytest.raises(oa.AgentTimeoutError), agent.scope(timeout=0.02) as ex:
        ex.state["x"] = 1
        time.sleep(0.05)
    assert agent.state == {}


# Processor


def test_span_outside_agent_untouched():
    """A span started outside any agent gets no agentcap attributes."""
    tracer = trace.get_tracer("foreign.lib")
    with capture_events() as captured, oa.run(_run_id()):
        tracer.start_span("plain", attributes={"x": 1}).end()
        tracer.start_span("chat m", attributes={attr.GEN_AI_OPERATION_NAME: "chat"}).end()
    for span in captured.spans:
        if span.attributes.get(attr.RUN_ROOT):
            continue  # the run's own root span
        assert not any(k.startswith("agentcap.") for k in span.attributes)
    assert captured.events == []


def test_foreign_chat_span_in_agent_becomes_model_call():
    """A foreign gen_ai chat span in an agent gets a sequence and event id and maps to model_call."""
    tracer = trace.get_tracer("foreign.genai")
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        memory["before"] = 1
        span = tracer.start_span(
            "chat claude-x",
            attributes={attr.GEN_AI_OPERATION_NAME: "chat", attr.GEN_AI_REQUEST_MODEL: "claude-x"},
        )
        span.set_attribute(attr.GEN_AI_USAGE_INPUT_TOKENS, 12)
        span.end()
        memory["after"] = 1
    a = next(s for s in captured.spans if s.name == "chat claude-x").attributes
    assert isinstance(a[attr.EVENT_SEQ], int) and a[attr.EVENT_ID]
    assert a[attr.EVENT_TYPE] == "model_call"
    assert a[attr.GEN_AI_AGENT_ID] == "alpha"
    events = captured.for_agent("alpha")
    types = [e.event_type for e in events]
    assert types == ["agent_start", "memory_write", "model_call", "memory_write", "agent_end"]
    model = events[2]
    assert model.payload["request_model"] == "claude-x"
    assert model.payload["usage"]["input_tokens"] == 12
    assert model.payload["span_name"] == "chat claude-x"


def test_foreign_chat_span_takes_caused_by_parents():
    """A foreign model-call span inside caused_by names those parents."""
    tracer = trace.get_tracer("foreign.genai")
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        ref = memory.set("prompt", "hi")
        with oa.caused_by(ref):
            tracer.start_span("chat m", attributes={attr.GEN_AI_OPERATION_NAME: "chat"}).end()
    model = captured.of_type("model_call")[0]
    assert model.causal_parent_ids == (ref.event_id,)


def test_other_foreign_span_in_agent_gets_only_ids():
    """A non-model foreign span in an agent gets run and agent ids but no event identity."""
    tracer = trace.get_tracer("foreign.http")
    run_id = _run_id()
    with capture_events() as captured, oa.run(run_id), oa.agent("alpha"):
        tracer.start_span("GET /x").end()
    a = next(s for s in captured.spans if s.name == "GET /x").attributes
    assert a[attr.RUN_ID] == run_id
    assert a[attr.AGENT_ID] == "alpha"
    assert a[attr.GEN_AI_AGENT_ID] == "alpha"
    assert attr.EVENT_ID not in a and attr.EVENT_SEQ not in a
    assert [e.event_type for e in captured.events] == ["agent_start", "agent_end"]


# Event ids


def test_event_ids_deterministic():
    """The same (run, agent, key) gives the same id; changing any part gives another."""
    import uuid as uuid_mod

    base = event_id_for("r", "a", "k")
    assert base == event_id_for("r", "a", "k")
    assert base == str(uuid_mod.uuid5(EVENT_NAMESPACE, "r\x1fa\x1fk"))
    assert (
        len(
            {
                base,
                event_id_for("r2", "a", "k"),
                event_id_for("r", "a2", "k"),
                event_id_for("r", "a", "k2"),
            }
        )
        == 4
    )


def test_ids_cannot_make_event_ids_collide():
    """Run and agent ids that would shift the id separator are rejected, so distinct events never
    share an id."""
    with pytest.raises(ValueError):
        oa.agent("x", agent_id="a\x1fb")
    with pytest.raises(ValueError), oa.run("r\x1fa"):
        pass


def test_spawn_event_id_same_for_same_identity_across_runs_of_the_program():
    """Spawning the same child in the same run from a fresh registry gives the same spawn event id."""
    from otel_agentcap.capture import agents as agents_module

    run_id = _run_id()
    with capture_events() as captured, oa.run(run_id):
        with oa.agent("parent"):
            oa.spawn("worker", key="k")
        agents_module._agents[run_id].pop("parent/k")  # as after a process restart
        with oa.agent("parent"):
            oa.spawn("worker", key="k")
    spawns = captured.of_type("agent_spawn")
    assert len(spawns) == 2
    assert spawns[0].event_id == spawns[1].event_id
    assert spawns[0].seq < spawns[1].seq


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20), st.text(max_size=40))
def test_event_id_is_uuid5_of_the_documented_name(run_id, agent_id, key):
    """event_id_for equals uuid5(EVENT_NAMESPACE, run \\x1f agent \\x1f key) for any text."""
    expected = str(uuid.uuid5(EVENT_NAMESPACE, f"{run_id}\x1f{agent_id}\x1f{key}"))
    assert event_id_for(run_id, agent_id, key) == expected


def test_timeout_before_the_worker_enters_still_records_the_failure():
    """A scope abandoned before its thread entered records agent_error, and the body never runs."""
    ran: list[bool] = []
    with capture_events() as captured, oa.run(_run_id()), oa.agent("parent") as parent:
        child = parent.spawn("late")
        scope = child.scope(timeout=5)
        scope.abandon(oa.AgentTimeoutError("timed out before start"))
        with pytest.raises(oa.AgentCancelled), scope:
            ran.append(True)
    assert ran == []
    errors = [e for e in captured.of_type("agent_error") if e.agent_id == child.agent_id]
    assert len(errors) == 1 and errors[0].payload["timed_out"] is True


def test_a_slow_spawn_registry_does_not_hold_up_other_agents_spawns():
    """The registration of a spawn (a database statement) runs outside any process-wide lock:
    while one agent's registration waits, another agent spawns, and a second spawn of the waiting
    child in the same process waits for the first instead of registering again."""
    from otel_agentcap.capture.agents import SpawnClaim, SpawnRecord, set_spawn_registry

    release = threading.Event()
    waiting = threading.Event()
    registered: list[str] = []

    class SlowRegistry:
        def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
            return None

        def register(self, claim: SpawnClaim) -> SpawnRecord:
            registered.append(claim.child_agent_id)
            if claim.child_agent_id == "slow/c":
                waiting.set()
                release.wait(10)
            return SpawnRecord(
                claim.parent_agent_id,
                claim.name,
                oa.EventRef(claim.spawn_event_id, claim.spawn_seq, claim.parent_agent_id),
                won=True,
            )

    run_id = _run_id()
    set_spawn_registry(SlowRegistry())
    children: list[oa.Agent] = []
    try:
        with oa.run(run_id):

            def slow_parent() -> None:
                with oa.agent("slow"):
                    children.append(oa.spawn("c", key="c"))

            first = oa.start_thread(slow_parent)
            assert waiting.wait(10)
            second = oa.start_thread(slow_parent)
            with oa.agent("fast"):
                child = oa.spawn("c", key="c")  # must not wait for the slow registration
            assert child.agent_id == "fast/c" and first.is_alive()
            release.set()
            first.join(10)
            second.join(10)
    finally:
        set_spawn_registry(None)
        release.set()
    assert children[0] is children[1]
    assert registered.count("slow/c") == 1


def test_a_spawn_registry_that_fails_is_logged_once_per_outage(caplog):
    """Spawns while the registry fails are recorded in this process, with one warning for the
    outage (no traceback), and one line when it answers again."""
    from otel_agentcap.capture.agents import SpawnClaim, SpawnRecord, set_spawn_registry

    down = True

    class FlakyRegistry:
        def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
            if down:
                raise ConnectionError("PostgreSQL was unreachable moments ago\nDETAIL: more")
            return None

        def register(self, claim: SpawnClaim) -> SpawnRecord:
            if down:
                raise ConnectionError("PostgreSQL was unreachable moments ago")
            return SpawnRecord(
                claim.parent_agent_id,
                claim.name,
                oa.EventRef(claim.spawn_event_id, claim.spawn_seq, claim.parent_agent_id),
                won=True,
            )

    set_spawn_registry(FlakyRegistry())
    try:
        with capture_events() as captured, oa.run(_run_id()), oa.agent("p"):
            spawned = [oa.spawn("c", key=f"k{i}") for i in range(4)]
            down = False
            spawned += [oa.spawn("c", key=f"k{i}") for i in range(4, 6)]
    finally:
        set_spawn_registry(None)
    assert len({child.agent_id for child in spawned}) == 6
    assert len(captured.of_type("agent_spawn")) == 6
    warnings = [r.getMessage() for r in caplog.records if "spawn registry" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "unreachable moments ago" in warnings[0] and "DETAIL" not in warnings[0]
    assert "answers again" in warnings[1]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_spawn_does_not_hold_a_lock_while_its_span_is_exported():
    """While an exporter is busy with one agent's spawn span (synchronous export), another agent
    spawns: no process-wide lock is held across the export."""
    from otel_agentcap.testing import InMemoryEventExporter
    from otel_agentcap.testing._capture import _ensure_installed

    release = threading.Event()
    exporting = threading.Event()

    class SlowSink(InMemoryEventExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            for span in spans:
                if span.name == "create_agent a/blocked":
                    exporting.set()
                    release.wait(10)
            return super().export(spans)

    sink = SlowSink()
    fan_out = _ensure_installed()
    fan_out.add(sink)
    try:
        with oa.run(_run_id()):

            def blocked() -> None:
                with oa.agent("a"):
                    oa.spawn("blocked")

            thread = oa.start_thread(blocked)
            assert exporting.wait(10)
            with oa.agent("b"):
                oa.spawn("free")
            assert thread.is_alive()
            release.set()
            thread.join(10)
    finally:
        release.set()
        fan_out.remove(sink)
    assert {e.payload["child_agent_id"] for e in sink.of_type("agent_spawn")} == {
        "a/blocked",
        "b/free",
    }


async def _later() -> int:
    return 5


def _items() -> Iterator[int]:
    yield 1


async def _aitems() -> Any:
    yield 1


def _sync_wrapper(fn: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(fn)
    def wrapper() -> Any:
        return fn()

    return wrapper


@pytest.mark.parametrize("timeout", [None, 5.0])
@pytest.mark.parametrize(
    ("fn", "kind", "recorded"),
    [
        (_later, "coroutine", False),
        (functools.partial(_later), "coroutine", False),
        (_items, "generator", False),
        (_sync_wrapper(_later), "coroutine", True),
        (_sync_wrapper(_items), "generator", True),
        (_aitems, "async generator", False),
        (_sync_wrapper(_aitems), "async generator", True),
    ],
)
def test_agent_run_refuses_a_body_that_would_run_after_its_execution(
    fn: Callable[[], Any], kind: str, recorded: bool, timeout: float | None
) -> None:
    """``Agent.run`` of an async or generator function returned the coroutine or generator and
    recorded ``agent_end`` at once: the body then ran outside the agent (its capture calls
    attributed to whichever agent awaited it). Refused with a ``TypeError``; when only the result
    shows it (a sync wrapper), inside the execution, which records the error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn
        with capture_events() as captured, oa.run(_run_id()), oa.agent("parent") as parent:
            child = parent.spawn("worker")
            with pytest.raises(TypeError, match=f"got a {kind} function"):
                child.run(fn, timeout=timeout)
        gc.collect()
    ends = [e.event_type for e in captured.events if e.agent_id == child.agent_id]
    assert ends == (["agent_start", "agent_error"] if recorded else [])


def test_a_run_that_times_out_while_its_state_is_being_committed_is_rolled_back():
    """Agent.run whose caller got AgentTimeoutError while the worker was still committing (a slow
    __deepcopy__ in the state) records the timeout and rolls the state back: the worker's late
    commit does not turn it into an agent_end with the state committed."""
    release = threading.Event()

    class SlowToCopy:
        def __deepcopy__(self, memo: dict[int, object]) -> SlowToCopy:
            if threading.current_thread().name.startswith("agent-"):
                release.wait(10)
            return SlowToCopy()

    def body() -> None:
        execution = oa.current_execution()
        assert execution is not None
        execution.state["slow"] = SlowToCopy()

    with capture_events() as captured, oa.run(_run_id()):
        agent = _root("slow-commit")
        with pytest.raises(oa.AgentTimeoutError):
            agent.run(body, timeout=0.05)
        release.set()
        for thread in threading.enumerate():
            if thread.name == "agent-slow-commit":
                thread.join(10)
    assert agent.state == {}
    events = [e.event_type for e in captured.for_agent("slow-commit")]
    assert events == ["agent_start", "agent_error"]
    assert captured.of_type("agent_error")[0].payload["timed_out"] is True


def test_an_agent_entered_in_the_thread_of_a_timed_out_execution_is_refused():
    """A thread left running by a timed-out Agent.run cannot go on acting by entering another
    agent: the scope raises AgentCancelled and records nothing."""
    go = threading.Event()
    outcome: list[BaseException | None] = []
    memory = oa.Memory("nested-late")

    def body() -> None:
        go.wait(10)
        try:
            with oa.agent("inner"):
                memory["k"] = "after the timeout"
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    with capture_events() as captured, oa.run(_run_id()):
        with pytest.raises(oa.AgentTimeoutError):
            _root("outer").run(body, timeout=0.05)
        go.set()
        for thread in threading.enumerate():  # the worker, if it got to run at all
            if thread.name == "agent-outer":
                thread.join(10)
    # The body got AgentCancelled (or, on a machine too slow to start it in time, never ran).
    assert all(isinstance(error, oa.AgentCancelled) for error in outcome)
    assert memory.snapshot() == {}
    assert captured.for_agent("inner") == []


def test_an_agent_open_inside_a_timed_out_execution_can_no_longer_act():
    """An agent scope that was open inside an execution when it timed out cannot go on acting
    for it: its capture calls raise AgentCancelled, and a block that swallowed them still fails
    and rolls back its state."""
    go = threading.Event()
    outcome: list[BaseException | None] = []
    memory = oa.Memory("nested-open")

    def body() -> None:
        try:
            with oa.agent("inner") as inner:
                inner.state["partial"] = 1
                go.wait(10)
                try:
                    memory["k"] = "after the timeout"
                except oa.AgentCancelled as exc:
                    outcome.append(exc)
        except BaseException as exc:
            outcome.append(exc)

    with capture_events() as captured, oa.run(_run_id()):
        with pytest.raises(oa.AgentTimeoutError):
            _root("outer").run(body, timeout=0.05)
        go.set()
        for thread in threading.enumerate():  # the worker, if it got to run at all
            if thread.name == "agent-outer":
                thread.join(10)
        inner_agent = _root("inner")
    # Both capture calls got AgentCancelled (or, on a machine too slow to start the body in time,
    # the timeout came before the inner agent was entered, or before the body ran at all).
    assert all(isinstance(error, oa.AgentCancelled) for error in outcome)
    assert memory.snapshot() == {}
    assert inner_agent.state == {}
    inner_events = [e.event_type for e in captured.for_agent("inner")]
    assert inner_events == (["agent_start", "agent_error"] if len(outcome) == 2 else [])


def test_a_task_left_running_by_a_timed_out_async_block_cannot_enter_another_agent():
    """A task a timed-out async block left running cannot go on acting by entering another agent
    either."""
    outcome: list[BaseException | None] = []
    memory = oa.Memory("nested-task")

    async def main() -> None:
        go = asyncio.Event()
        leftover: list[asyncio.Task[None]] = []

        async def late() -> None:
            await go.wait()
            try:
                async with oa.agent("inner"):
                    memory["k"] = "after the timeout"
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        with pytest.raises(TimeoutError):
            async with oa.agent("outer", timeout=0.05):
                leftover.append(asyncio.get_running_loop().create_task(late()))
                await asyncio.sleep(10)
        go.set()
        await leftover[0]

    with capture_events() as captured, oa.run(_run_id()):
        asyncio.run(main())
    assert len(outcome) == 1 and isinstance(outcome[0], oa.AgentCancelled)
    assert memory.snapshot() == {}
    assert captured.for_agent("inner") == []


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_timeout_that_is_not_a_positive_number_is_refused_at_the_call(timeout: float) -> None:
    """A zero, negative or NaN timeout is a ValueError at the call, for Agent.run, arun and
    scopes alike (NaN was taken as no timeout by scopes and as an immediate timeout by
    Agent.run, which recorded a timed-out execution 'after nan s')."""
    agent = _root("bad-timeout")
    with capture_events() as captured:
        with pytest.raises(ValueError, match="timeout must be"):
            agent.run(lambda: 1, timeout=timeout)
        with pytest.raises(ValueError, match="timeout must be"):
            agent.scope(timeout=timeout)
        with pytest.raises(ValueError, match="timeout must be"):
            oa.agent("bad-timeout", timeout=timeout)
        with pytest.raises(ValueError, match="timeout must be"):
            asyncio.run(agent.arun(asyncio.sleep, 0, timeout=timeout))
    assert captured.for_agent("bad-timeout") == []


def test_an_infinite_timeout_is_no_timeout() -> None:
    """timeout=math.inf runs as no timeout (Agent.run in the caller's thread; it waited in a
    worker thread and raised OverflowError when the body was still running)."""
    agent = _root("endless")
    caller = threading.current_thread()
    assert agent.run(lambda: threading.current_thread() is caller, timeout=math.inf) is True
    with agent.scope(timeout=math.inf) as execution:
        assert execution.context.deadline is None


@pytest.mark.fault
def test_a_block_interrupted_while_its_state_is_committed_fails_and_unbinds_its_agent() -> None:
    """A Ctrl-C while a block's state is copied for its commit (KeyboardInterrupt from a
    __deepcopy__) left the agent bound after the block (later code was recorded as the agent's)
    and never ended its span (not even agent_start reached the log); the execution is now
    recorded as failed, its state rolled back, and the agent unbound, before the interrupt goes
    on."""

    class Interrupts:
        def __deepcopy__(self, memo: dict[int, object]) -> Interrupts:
            raise KeyboardInterrupt

    memory = oa.Memory("after-interrupt")
    with capture_events() as captured, oa.run(_run_id()):
        agent = _root("interrupted")
        with pytest.raises(KeyboardInterrupt), agent.scope() as execution:
            execution.state["x"] = Interrupts()
        assert oa.current_execution() is None
        memory["k"] = 1  # outside any agent: not recorded
    assert agent.state == {}
    events = captured.for_agent("interrupted")
    assert [e.event_type for e in events] == ["agent_start", "agent_error"]
    assert events[1].payload["error_type"] == "KeyboardInterrupt"
    assert events[1].payload["discarded_state_keys"] == ["x"]
    assert captured.of_type("memory_write") == []


def test_executions_entered_one_after_another_in_carried_contexts_are_not_kept_alive() -> None:
    """An execution that ended is not kept alive by the executions entered later in a context
    carried from it (a worker hopping from thread to thread): the link that lets a timed-out
    execution stop the agents entered inside it is dropped when it ends."""
    refs: list[weakref.ref[Any]] = []
    last: list[Any] = []

    def hop(n: int) -> None:
        with oa.agent("hopper") as execution:
            refs.append(weakref.ref(execution))
            carried = contextvars.copy_context()
        if n:
            thread = threading.Thread(target=carried.run, args=(hop, n - 1))
            thread.start()
            thread.join()
        else:
            last.append(carried)

    with oa.run(_run_id()):
        hop(5)
        gc.collect()
        assert last  # the last carried context is alive, and with it the last execution
        assert [ref() is None for ref in refs[:-1]] == [True] * 5


def test_a_tool_call_replayed_inside_a_timed_out_execution_is_refused():
    """A nested agent of a timed-out execution that repeats a tool call gets AgentCancelled, not
    the recorded result: a replay acts for the execution too (it hands the agent an outcome)."""
    go = threading.Event()
    outcome: list[object] = []

    @oa.tool
    def lookup(x: int) -> int:
        return x * 2

    def body() -> None:
        with oa.agent("inner"):
            outcome.append(lookup.invoke("call-1", 1))
            go.wait(10)
            try:
                outcome.append(lookup.invoke("call-1", 1))
            except oa.AgentCancelled as exc:
                outcome.append(exc)

    with oa.run(_run_id()):
        with pytest.raises(oa.AgentTimeoutError):
            _root("outer").run(body, timeout=0.05)
        go.set()
        for thread in threading.enumerate():  # the worker, if it got to run at all
            if thread.name == "agent-outer":
                thread.join(10)
    # On a machine too slow to make the first call within the timeout, it was refused instead.
    assert outcome[-1:] == [] or isinstance(outcome[-1], oa.AgentCancelled)
