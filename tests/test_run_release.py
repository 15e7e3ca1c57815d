"""A run's in-process state is released when its last scope closes, and nothing it promised breaks:
sequences stay unique and increasing across a release, also for a thread that outlives the run."""

from __future__ import annotations

import threading
import uuid

import pytest

import otel_agentcap as oa
from otel_agentcap.capture import agents as agents_module
from otel_agentcap.capture.tools import _stored_error, invocations
from otel_agentcap.clock import ClockRegistry, clocks
from otel_agentcap.model import EventRef
from otel_agentcap.pipeline import causal_links
from otel_agentcap.runs import lifetimes
from otel_agentcap.testing import capture_events


def _run_id() -> str:
    return f"release-{uuid.uuid4().hex[:12]}"


@oa.tool
def double(x: int) -> int:
    return 2 * x


@oa.tool
def fail(x: int) -> int:
    raise ValueError(f"bad {x}")


def _held(run_id: str) -> dict[str, int]:
    """What the process-wide registries hold of ``run_id``."""
    return {
        "clocks": sum(1 for key in clocks._clocks if key[0] == run_id),
        "agents": len(agents_module._agents.get(run_id, {})),
        "invocations": sum(
            len(table.calls(invocation_id))
            for table in invocations._runs.get(run_id, {}).values()
            for invocation_id in table.by_id
        ),
        "links": sum(
            len(registry._runs.get(run_id, {}))
            for registry in (causal_links._by_response, causal_links._tool_results)
        ),
    }


def _work(run_id: str) -> None:
    with oa.agent("planner"):
        double.invoke("call-1", 1)
        with pytest.raises(ValueError):
            fail.invoke("call-2", 2)
        causal_links.record_tool_result(run_id, "toolu_1", EventRef("e", 1, "planner"))
        child = oa.spawn("worker", key="w")
        child.run(lambda: double.invoke("call-3", 3))


def test_closing_the_last_scope_releases_everything_the_run_held():
    run_id = _run_id()
    with oa.run(run_id, resume=True):
        _work(run_id)
        # The tool result is indexed for its agent and for the run.
        assert _held(run_id) == {"clocks": 2, "agents": 2, "invocations": 3, "links": 2}
        assert lifetimes.is_open(run_id)
    assert _held(run_id) == {"clocks": 0, "agents": 0, "invocations": 0, "links": 0}
    assert not lifetimes.is_open(run_id)


def test_an_agent_outside_any_run_releases_its_generated_run():
    with oa.agent("solo") as execution:
        double.invoke("call-1", 1)
        run_id = execution.run_id
        assert _held(run_id)["invocations"] == 1
    assert _held(run_id) == {"clocks": 0, "agents": 0, "invocations": 0, "links": 0}


def test_many_runs_leave_the_registries_as_they_were():
    before = (len(clocks), len(invocations), len(causal_links._tool_results))
    for _ in range(200):
        run_id = _run_id()
        with oa.run(run_id, resume=True):
            _work(run_id)
    assert (len(clocks), len(invocations), len(causal_links._tool_results)) == before


def test_a_run_stays_held_while_another_scope_of_it_is_open():
    """Two threads in one run: the first to leave releases nothing the other still uses."""
    run_id = _run_id()
    calls: list[int] = []

    @oa.tool
    def once(x: int) -> int:
        calls.append(x)
        return x

    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with oa.run(run_id, resume=True), oa.agent("planner"):
            once.invoke("shared", 1)
            inside.set()
            leave.wait(10)
            assert once.invoke("shared", 1) == 1  # replayed: the outcome was kept

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    with oa.run(run_id, resume=True), oa.agent("planner"):
        pass
    leave.set()
    thread.join(10)
    assert calls == [1]
    assert _held(run_id)["invocations"] == 0


def _sequences(events: list[oa.Event], agent_id: str) -> list[int]:
    return [event.seq for event in events if event.agent_id == agent_id]


def test_a_run_entered_again_continues_above_its_released_sequences():
    run_id = _run_id()
    with capture_events() as captured:
        for _ in range(3):
            with oa.run(run_id, resume=True), oa.agent("planner"):
                double(1)
    events = captured.events
    seqs = _sequences(events, "planner")
    assert len(seqs) == 12  # agent_start, tool_invocation, tool_result, agent_end per entry
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert len({event.event_id for event in events}) == len(events)


def test_a_thread_that_outlives_its_run_shares_the_clock_of_a_later_entry():
    """A context kept by a thread after the run was released ticks the same logical clock as the
    run entered again, so no sequence repeats."""
    run_id = _run_id()
    released = threading.Event()
    go = threading.Event()
    done = threading.Event()

    def late() -> None:
        released.wait(10)
        go.wait(10)
        for i in range(50):
            double(i)
        done.set()

    with capture_events() as captured:
        with oa.run(run_id, resume=True), oa.agent("planner"):
            oa.start_thread(late)
        released.set()
        assert _held(run_id)["clocks"] == 0
        with oa.run(run_id, resume=True), oa.agent("planner"):
            go.set()
            for i in range(50):
                double(i)
            assert done.wait(10)
    seqs = _sequences(captured.events, "planner")
    assert len(seqs) == 4 + 200
    assert len(set(seqs)) == len(seqs)


def test_a_run_past_the_kept_floors_starts_above_every_forgotten_run():
    registry = ClockRegistry(max_finished_runs=2)
    for n, run_id in enumerate(["r1", "r2", "r3"]):
        clock = registry.get(run_id, "a")
        for _ in range(10 * (n + 1)):
            clock.tick()
        registry.forget_run(run_id)
    assert registry.get("r2", "a").tick() == 21  # its own floor is kept
    assert registry.get("r1", "a").tick() == 11  # forgotten: above the highest forgotten (r1's)
    assert registry.get("new", "a").tick() == 11
    registry.forget_run("r3")


def test_a_stored_error_keeps_its_chain_but_no_frames():
    def failing() -> None:
        big = bytearray(1_000_000)  # noqa: F841 - a local the traceback would keep alive
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer") from inner

    with pytest.raises(ValueError) as raised:
        failing()
    stored = _stored_error(raised.value)
    assert stored is not raised.value and raised.value.__traceback__ is not None
    assert stored.__traceback__ is None
    assert isinstance(stored.__cause__, KeyError) and stored.__cause__.__traceback__ is None
    assert str(stored) == "outer" and stored.__suppress_context__


def test_a_replayed_error_is_the_recorded_one_after_storage():
    run_id = _run_id()
    with oa.run(run_id, resume=True), oa.agent("planner"):
        with pytest.raises(ValueError, match="bad 2") as first:
            fail.invoke("call", 2)
        with pytest.raises(ValueError, match="bad 2") as replayed:
            fail.invoke("call", 2)
    assert replayed.value is not first.value
