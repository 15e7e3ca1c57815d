"""Captured tools: exactly-once execution per (run, agent, invocation id), events and spans."""

from __future__ import annotations

import asyncio
import copy
import functools
import gc
import json
import pickle
import threading
import time
import types
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.capture._telemetry import Encoded, outcome_record
from otel_agentcap.capture.tools import invocations
from otel_agentcap.clock import LamportClock
from otel_agentcap.context import current_agent
from otel_agentcap.model import EventRef, EventType
from otel_agentcap.pipeline.stamping import stamp
from otel_agentcap.testing import capture_events


def _run_id() -> str:
    return f"tools-{uuid.uuid4().hex[:12]}"


class Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0

    def bump(self) -> int:
        with self.lock:
            self.n += 1
            return self.n


def test_concurrent_thread_retries_run_body_once():
    """32 threads retrying one invocation id at once run the body once and all get its result."""
    calls = Counter()
    barrier = threading.Barrier(32)

    @oa.tool
    def slow(x: int) -> dict[str, int]:
        n = calls.bump()
        time.sleep(0.2)
        return {"x": x, "n": n}

    results: list[object] = [None] * 32

    def retry(i: int) -> None:
        barrier.wait()
        results[i] = slow.invoke("call-1", 5)

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        threads = [oa.start_thread(retry, i) for i in range(32)]
        for t in threads:
            t.join()
    assert calls.n == 1
    assert all(r == {"x": 5, "n": 1} for r in results)
    assert len(captured.of_type("tool_invocation")) == 1
    assert len(captured.of_type("tool_result")) == 1


def test_counting_the_registry_while_threads_claim_new_invocation_ids():
    """len(invocations) counts while four threads of one agent claim new ids (which they add
    without the table's lock), each id twice: no error, every body runs once per id."""
    calls = Counter()
    barrier = threading.Barrier(5)
    done = threading.Event()

    @oa.tool
    def quick(x: int) -> list[int]:
        calls.bump()
        return [x]

    def claim_all(offset: int) -> None:
        barrier.wait()
        for i in range(300):
            assert quick.invoke(f"id-{(offset + i) % 600}", 1) == [1]

    def count() -> None:
        barrier.wait()
        while not done.is_set():
            len(invocations)

    with oa.run(_run_id()), oa.agent("alpha"):
        counter = threading.Thread(target=count)
        counter.start()
        threads = [oa.start_thread(claim_all, offset) for offset in (0, 300, 150, 450)]
        for t in threads:
            t.join()
        done.set()
        counter.join()
    assert calls.n == 600


def test_concurrent_async_retries_run_body_once():
    """20 concurrent asyncio retries of one invocation run an async body once and share the result."""
    calls = Counter()

    @oa.tool
    async def slow(x: int) -> int:
        calls.bump()
        await asyncio.sleep(0.1)
        return x * 2

    async def main() -> list[int]:
        async with oa.agent("alpha"):
            return await asyncio.gather(*(slow.invoke("call-1", 21) for _ in range(20)))

    with capture_events() as captured, oa.run(_run_id()):
        results = asyncio.run(main())
    assert results == [42] * 20
    assert calls.n == 1
    assert len(captured.of_type("tool_result")) == 1


def test_sequential_retry_returns_recorded_result_without_rerun():
    """A later retry of the same call (id, tool and input) returns the first result without
    running the body, whatever order its keyword arguments come in."""
    calls = Counter()

    @oa.tool
    def once(x: int, y: int = 0) -> int:
        calls.bump()
        return x + y + calls.n * 100

    with oa.run(_run_id()), oa.agent("alpha"):
        assert once.invoke("c", 1, y=2) == 103
        assert once.invoke("c", y=2, x=1) == 103
        assert once.invoke("c", 1, 2) == 103
    assert calls.n == 1


def test_a_reused_id_with_other_input_or_tool_is_a_call_of_its_own():
    """The same invocation id with another input, or another tool, runs and is recorded as its own
    invocation (its events carry the reuse and keys of their own); each call's retries replay its
    own outcome."""
    calls: list[tuple[str, int]] = []

    @oa.tool
    def first(x: int) -> str:
        calls.append(("first", x))
        return f"first-{x}"

    @oa.tool
    def second(x: int) -> str:
        calls.append(("second", x))
        return f"second-{x}"

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        assert first.invoke("toolu_1", 1) == "first-1"
        assert first.invoke("toolu_1", 2) == "first-2"
        assert second.invoke("toolu_1", 1) == "second-1"
        assert first.invoke("toolu_1", 2) == "first-2"  # replayed
        assert second.invoke("toolu_1", 1) == "second-1"  # replayed
    assert calls == [("first", 1), ("first", 2), ("second", 1)]
    invocations_ = captured.of_type("tool_invocation")
    assert [e.payload.get("id_reuse") for e in invocations_] == [None, 1, 2]
    assert len({e.event_id for e in invocations_}) == 3
    assert len({e.idempotency_key for e in captured.events}) == len(captured.events)
    assert captured.of_type("agent_error") == []


def test_run_again_records_each_execution_as_the_next_attempt():
    """Tool.run_again always runs the body; each execution of the same call is the next attempt,
    with events of its own, and an exact re-send of one attempt's spans is still one event."""
    calls = Counter()

    @oa.tool
    def work(x: int) -> int:
        return calls.bump()

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        assert [work.run_again("toolu_1", 1) for _ in range(3)] == [1, 2, 3]
        assert work.invoke("toolu_1", 1) == 3  # exactly-once replays the latest attempt
    results = captured.of_type("tool_result")
    assert [e.payload.get("attempt") for e in results] == [None, 2, 3]
    assert [e.idempotency_key for e in results] == [
        "tool:toolu_1:result",
        "tool:toolu_1\x1fattempt2:result",
        "tool:toolu_1\x1fattempt3:result",
    ]
    assert calls.n == 3


def test_reserved_looking_parameters_reach_the_tool_untouched():
    """Parameters named agent_id, run_id, log, clock and invocation_id are passed as given."""
    seen: list[dict[str, object]] = []

    @oa.tool
    def sneaky(agent_id, run_id, log, clock, invocation_id):
        seen.append(
            {
                "agent_id": agent_id,
                "run_id": run_id,
                "log": log,
                "clock": clock,
                "invocation_id": invocation_id,
            }
        )
        return "ok"

    args = {"agent_id": "A", "run_id": "R", "log": ["l"], "clock": 3, "invocation_id": "I"}
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        sneaky(**args)
        sneaky.invoke("real-id", **args)
        sneaky.invoke("positional", "A", "R", ["l"], 3, "I")
    assert seen == [args, args, args]
    invocations_ = captured.of_type("tool_invocation")
    assert [e.payload["arguments"] for e in invocations_] == [args] * 3
    assert [e.payload["invocation_id"] for e in invocations_][1:] == ["real-id", "positional"]


class CustomError(Exception):
    pass


def test_recorded_error_re_raised_with_same_type_without_rerun():
    """A failed invocation re-raises the same error type on retry and does not re-run the body."""
    calls = Counter()

    @oa.tool
    def fails() -> None:
        calls.bump()
        raise CustomError("boom")

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        for _ in range(3):
            with pytest.raises(CustomError, match="boom"):
                fails.invoke("c")
    assert calls.n == 1
    errors = captured.of_type("agent_error")
    assert len(errors) == 1
    assert errors[0].payload["error_type"].endswith("CustomError")
    assert errors[0].payload["invocation_id"] == "c"


def test_replayed_error_keeps_its_cause():
    """A replayed error carries the cause it was raised from, like the first one did."""

    @oa.tool
    def refuses() -> None:
        try:
            raise LookupError("no such element")
        except LookupError as cause:
            raise CustomError("refused") from cause

    with oa.run(_run_id()), oa.agent("alpha"):
        raised = []
        for _ in range(2):
            with pytest.raises(CustomError) as info:
                refuses.invoke("c")
            raised.append(info.value)
    assert raised[0] is not raised[1]
    for error in raised:
        assert isinstance(error.__cause__, LookupError)
        assert str(error.__cause__) == "no such element"


def test_same_invocation_id_in_other_agent_or_run_runs_again():
    """Invocation ids are scoped by run and agent: another agent or run executes its own call."""
    calls = Counter()

    @oa.tool
    def work() -> int:
        return calls.bump()

    run_a, run_b = _run_id(), _run_id()
    with oa.run(run_a):
        with oa.agent("alpha"):
            first = work.invoke("same")
        with oa.agent("beta"):
            second = work.invoke("same")
        with oa.agent("alpha"):
            again = work.invoke("same")
    with oa.run(run_b), oa.agent("alpha"):
        third = work.invoke("same")
    assert (first, second, again, third) == (1, 2, 1, 3)


def test_invocation_and_result_events():
    """A call records tool_invocation with arguments, then tool_result with the result, caused by it."""

    @oa.tool
    def add(a: int, b: int = 10) -> int:
        return a + b

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        add.invoke("toolu_1", 2, b=3)
    inv, res = captured.of_type("tool_invocation"), captured.of_type("tool_result")
    assert len(inv) == len(res) == 1
    assert inv[0].payload == {
        "tool": "add",
        "invocation_id": "toolu_1",
        "arguments": {"a": 2, "b": 3},
    }
    assert res[0].payload == {"tool": "add", "invocation_id": "toolu_1", "result": 5}
    assert res[0].causal_parent_ids == (inv[0].event_id,)
    assert inv[0].seq < res[0].seq
    assert inv[0].span_id == res[0].span_id


@pytest.mark.parametrize(
    ("name", "invocation_id"),
    [
        ('quote"tool', 'id "with" \\ quotes'),
        ("unicode-\u00fc", "id-\u00e9\u4e2d\U0001f600-\n-tab\t"),
        ("$agentcap.tool", "$agentcap.id"),
    ],
)
def test_payloads_with_names_and_ids_json_must_escape(name: str, invocation_id: str):
    """Tool names and invocation ids reach the payloads intact, whatever JSON has to escape."""
    echo = oa.tool(lambda text: text, name=name)
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        echo.invoke(invocation_id, 'a "b"')
    (inv,), (res,) = captured.of_type("tool_invocation"), captured.of_type("tool_result")
    assert inv.payload == {
        "tool": name,
        "invocation_id": invocation_id,
        "arguments": {"text": 'a "b"'},
    }
    assert res.payload == {"tool": name, "invocation_id": invocation_id, "result": 'a "b"'}


def test_huge_arguments_and_result_are_bounded_and_the_call_stays_readable():
    """An argument or result over the payload limit becomes a truncation marker in its own field;
    the tool name and invocation id around it are kept."""
    big = "x" * 300_000
    echo = oa.tool(lambda text: text, name="echo")
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        assert echo.invoke("toolu_big", big) == big
    (inv,), (res,) = captured.of_type("tool_invocation"), captured.of_type("tool_result")
    assert (inv.payload["tool"], inv.payload["invocation_id"]) == ("echo", "toolu_big")
    assert set(inv.payload["arguments"]) == {"$agentcap.truncated", "size"}
    assert inv.payload["arguments"]["size"] == len('{"text":""}') + len(big)
    assert (res.payload["tool"], res.payload["invocation_id"]) == ("echo", "toolu_big")
    assert res.payload["result"]["$agentcap.truncated"].startswith('"xxx')
    assert res.payload["result"]["size"] == len(big) + 2


def test_execute_tool_span_and_genai_attributes():
    """The span is named execute_tool {name} and carries the gen_ai tool attributes."""

    @oa.tool(name="lookup_weather")
    def weather(city: str) -> str:
        return "sunny"

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        weather.invoke("toolu_9", "Oslo")
    spans = [s for s in captured.spans if s.name.startswith("execute_tool")]
    assert [s.name for s in spans] == ["execute_tool lookup_weather"]
    a = spans[0].attributes
    assert a[attr.GEN_AI_OPERATION_NAME] == "execute_tool"
    assert a[attr.GEN_AI_TOOL_NAME] == "lookup_weather"
    assert a[attr.GEN_AI_TOOL_CALL_ID] == "toolu_9"
    assert a[attr.GEN_AI_TOOL_TYPE] == "function"
    assert a[attr.GEN_AI_AGENT_ID] == "alpha"
    assert a[attr.EVENT_TYPE] == "tool_invocation"


def test_tool_body_spans_are_children_of_the_tool_span():
    """A memory write inside a tool body is captured in the tool span's trace, as its child."""
    memory = oa.Memory()

    @oa.tool
    def writes() -> None:
        memory["k"] = 1

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        writes()
    tool_span = next(s for s in captured.spans if s.name.startswith("execute_tool"))
    write_span = next(s for s in captured.spans if s.name == "memory_write")
    assert write_span.parent is not None
    assert write_span.parent.span_id == tool_span.context.span_id


def test_cancelled_first_attempt_lets_retry_run():
    """An asyncio-cancelled first attempt is not an outcome: a retry runs the body again."""
    calls = Counter()

    @oa.tool
    async def slow() -> str:
        n = calls.bump()
        if n == 1:
            await asyncio.sleep(10)
        return f"done-{n}"

    async def main() -> str:
        async with oa.agent("alpha"):
            first = asyncio.create_task(slow.invoke("c"))
            await asyncio.sleep(0.05)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            return await asyncio.wait_for(slow.invoke("c"), 5)

    with capture_events() as captured, oa.run(_run_id()):
        assert asyncio.run(main()) == "done-2"
    assert calls.n == 2
    invocation_events = captured.of_type("tool_invocation")
    assert len(invocation_events) == 2
    assert len({e.event_id for e in invocation_events}) == 2


def test_waiter_on_cancelled_attempt_runs_the_body_itself():
    """A retry waiting on an attempt that gets cancelled claims the invocation and runs it."""
    calls = Counter()

    @oa.tool
    async def slow() -> int:
        n = calls.bump()
        await asyncio.sleep(10 if n == 1 else 0)
        return n

    async def main() -> int:
        async with oa.agent("alpha"):
            first = asyncio.create_task(slow.invoke("c"))
            await asyncio.sleep(0.05)
            waiter = asyncio.create_task(slow.invoke("c"))
            await asyncio.sleep(0.05)
            first.cancel()
            return await asyncio.wait_for(waiter, 5)

    with oa.run(_run_id()):
        assert asyncio.run(main()) == 2
    assert calls.n == 2


def test_calls_outside_an_agent_run_and_are_not_captured():
    """Outside any agent the tool runs normally, nothing is recorded and nothing is deduplicated."""
    calls = Counter()

    @oa.tool
    def work(x: int) -> int:
        calls.bump()
        return x

    with capture_events() as captured:
        assert work(1) == 1
        assert work.invoke("c", 2) == 2
        assert work.invoke("c", 3) == 3
    assert calls.n == 3
    assert captured.spans == []


def test_retry_after_restart_reuses_event_ids():
    """After the in-process registry is lost (restart), a re-run records events with the same ids."""

    @oa.tool
    def work() -> int:
        return 1

    run_id = _run_id()
    with capture_events() as captured, oa.run(run_id):
        with oa.agent("alpha"):
            work.invoke("c")
        invocations.forget_run(run_id)
        with oa.agent("alpha"):
            work.invoke("c")
    ids = [e.event_id for e in captured.of_type("tool_invocation")]
    assert len(ids) == 2 and ids[0] == ids[1]
    seqs = [e.seq for e in captured.of_type("tool_invocation")]
    assert seqs[0] < seqs[1]


def test_method_tool_binds_self():
    """A tool defined as a method receives its instance and is captured."""

    class Box:
        def __init__(self) -> None:
            self.v = 4

        @oa.tool
        def get(self, add: int) -> int:
            return self.v + add

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        assert Box().get.invoke("m", 1) == 5
    assert captured.of_type("tool_result")[0].payload["result"] == 5


def test_tool_in_cancelled_agent_raises_agent_cancelled():
    """A tool call from an execution that already failed raises AgentCancelled and does not run."""
    calls = Counter()

    @oa.tool
    def work() -> None:
        calls.bump()

    with oa.run(_run_id()):
        scope = oa.agent("alpha")
        with pytest.raises(RuntimeError), scope as execution:
            raise RuntimeError("x")
        ctx = execution.context
        from otel_agentcap.context import bind_agent, reset_agent

        token = bind_agent(ctx)
        try:
            with pytest.raises(oa.AgentCancelled):
                work()
        finally:
            reset_agent(token)
    assert calls.n == 0


def test_registry_keeps_a_bounded_number_of_finished_outcomes():
    """Finished outcomes beyond the bound are forgotten oldest first; recent ones still replay."""
    from otel_agentcap.capture.tools import invocations

    calls: list[int] = []

    @oa.tool
    def count(x: int) -> int:
        calls.append(x)
        return x

    saved = invocations.max_completed
    invocations.max_completed = 3
    try:
        with oa.run(f"bounded-{uuid.uuid4().hex[:8]}"), oa.agent("a"):
            for i in range(5):
                count.invoke(f"c{i}", i)
            assert count.invoke("c4", 4) == 4  # recent: replayed, body not run
            assert count.invoke("c0", 0) == 0  # evicted: runs again
    finally:
        invocations.max_completed = saved
    assert calls == [0, 1, 2, 3, 4, 0]


def test_an_interrupted_at_most_once_call_is_not_run_again():
    """An at_most_once tool whose attempt was interrupted (the body may have acted) is not run
    again: its retries raise ToolOutcomeUnknown saying it was interrupted while its body ran
    (not that a process stopped); an at_least_once tool runs again."""
    calls = Counter()

    @oa.tool(crash_policy="at_most_once")
    def charge() -> None:
        calls.bump()
        raise KeyboardInterrupt

    @oa.tool
    def read() -> int:
        n = calls.bump()
        if n == 2:
            raise KeyboardInterrupt
        return n

    with oa.run(_run_id()), oa.agent("alpha"):
        with pytest.raises(KeyboardInterrupt):
            charge.invoke("c")
        for _ in range(2):
            with pytest.raises(oa.ToolOutcomeUnknown) as info:
                charge.invoke("c")
            assert info.value.invocation_id == "c" and info.value.tool == "charge"
            assert "interrupted while its body ran" in str(info.value), str(info.value)
            assert "process" not in str(info.value), str(info.value)  # this one did not stop
            assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
        with pytest.raises(KeyboardInterrupt):
            read.invoke("r")
        assert read.invoke("r") == 3
    assert calls.n == 3


def test_the_invocation_is_readable_inside_the_body():
    """current_invocation() inside a body names the call; outside any body it is None; a plain
    call has no invocation id and no idempotency key."""
    seen: list[oa.InvocationInfo | None] = []

    @oa.tool
    def probe(x: int) -> None:
        seen.append(oa.current_invocation())

    with oa.run(_run_id()), oa.agent("alpha"):
        probe.invoke("p-1", 1)
        probe(2)
    assert oa.current_invocation() is None
    first, plain = seen
    assert first is not None and plain is not None
    assert (first.invocation_id, first.tool, first.attempt, first.agent_id) == (
        "p-1",
        "probe",
        1,
        "alpha",
    )
    assert first.idempotency_key is not None and plain.idempotency_key is None
    assert plain.invocation_id is None


def test_a_replayed_result_is_the_callers_own():
    """Mutating a result, the first caller's or a replayed one, changes neither later replays
    nor the recorded event."""

    @oa.tool
    def make() -> dict[str, list[int]]:
        return {"items": [1]}

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        first = make.invoke("m")
        first["items"].append(2)
        replayed = make.invoke("m")
        assert replayed == {"items": [1]}
        replayed["items"].append(3)
        assert make.invoke("m") == {"items": [1]}
    assert captured.of_type("tool_result")[0].payload["result"] == {"items": [1]}


def test_replayed_results_keep_their_types() -> None:
    """A replayed result is equal to the first, with the same types throughout: plain data,
    values json cannot hold, and subclasses of plain types alike."""

    class Name(str):
        pass

    results: dict[str, Any] = {
        "plain": {"a": [1, 2.5, None, True], "t": (1, [2])},
        "bytes": {"raw": bytearray(b"xy"), "set": {1}},
        "subclass": [Name("n"), {"k": Name("v")}],
        "non-str keys": {1: "a", "1": "b"},
    }

    @oa.tool
    def make(kind: str) -> Any:
        return copy.deepcopy(results[kind])

    with oa.run(_run_id()), oa.agent("alpha"):
        for kind, expected in results.items():
            make.invoke(kind, kind)
            replayed = make.invoke(kind, kind)
            assert replayed == expected
            assert repr(replayed) == repr(expected)  # a tuple stays a tuple
        assert type(make.invoke("bytes", "bytes")["raw"]) is bytearray
        assert type(make.invoke("subclass", "subclass")[1]["k"]) is Name


def _sync_wrapper(fn: Any) -> Any:
    """A decorator that knows nothing of asyncio: its wrapper is a plain function that returns
    what ``fn`` returns (for an async ``fn``, a coroutine), as many decorator libraries write."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class _AsyncCallable:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, x: int) -> int:
        self.calls += 1
        await asyncio.sleep(0.01)
        return x * 3


@pytest.mark.parametrize("shape", ["async __call__", "partial of async __call__", "sync wrapper"])
def test_async_bodies_behind_other_callables_are_awaited_in_the_tool_span(shape: str) -> None:
    """A tool whose calls return coroutines although it is not an ``async def`` function (an
    object with an async ``__call__``, a partial of one, a sync decorator's wrapper) records the
    awaited result, runs its body inside its span, and replays that result: it recorded the
    coroutine object's repr, and a retry got the same, already awaited, coroutine back."""
    memory = oa.Memory()
    ran: list[int] = []

    async def body(x: int) -> int:
        ran.append(x)
        memory["seen"] = x
        await asyncio.sleep(0.01)
        return x * 3

    if shape == "async __call__":
        target: Any = _AsyncCallable()
        counted = target
    elif shape == "partial of async __call__":
        target = functools.partial(_AsyncCallable())
        counted = target.func
    else:
        target = _sync_wrapper(body)
        counted = None
    tripled = oa.tool(name="tripled")(target)

    async def main() -> list[int]:
        async with oa.agent("alpha"):
            first = await asyncio.gather(*(tripled.invoke("t-1", 5) for _ in range(3)))
            again = await tripled.invoke("t-1", 5)
            return [*first, again]

    with capture_events() as captured, oa.run(_run_id()):
        assert asyncio.run(asyncio.wait_for(main(), 10)) == [15, 15, 15, 15]
    assert (counted.calls if counted is not None else len(ran)) == 1
    (result,) = captured.of_type("tool_result")
    assert result.payload["result"] == 15
    tool_span = next(s for s in captured.spans if s.name == "execute_tool tripled")
    if counted is None:
        write_span = next(s for s in captured.spans if s.name == "memory_write")
        assert write_span.parent is not None
        assert write_span.parent.span_id == tool_span.context.span_id
        assert write_span.end_time <= tool_span.end_time


def test_a_sync_wrapper_that_raises_after_awaiting_records_the_error() -> None:
    """The error of a coroutine a sync wrapper returned is the call's outcome, replayed."""

    @oa.tool
    @_sync_wrapper
    async def fails(x: int) -> int:
        await asyncio.sleep(0)
        raise KeyError(x)

    async def main() -> None:
        async with oa.agent("alpha"):
            for _ in range(2):
                with pytest.raises(KeyError):
                    await fails.invoke("f-1", 1)

    with capture_events() as captured, oa.run(_run_id()):
        asyncio.run(main())
    (error,) = captured.of_type("agent_error")
    assert error.payload["error_type"] == "KeyError"
    assert not captured.of_type("tool_result")


def _numbers(n: int) -> Any:
    yield from range(n)


async def _anumbers(n: int) -> Any:
    for i in range(n):
        yield i


class _GeneratorCallable:
    def __call__(self, n: int) -> Any:
        yield from range(n)


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        (_numbers, "generator"),
        (_anumbers, "async generator"),
        (functools.partial(_numbers, 3), "generator"),
        (_GeneratorCallable(), "generator"),
    ],
)
def test_generator_functions_are_refused_as_tools(fn: Any, kind: str) -> None:
    """A generator's body runs as its caller iterates, after the call returned: it recorded the
    generator's repr as the result, and a retry got the same, exhausted, generator back."""
    with pytest.raises(TypeError, match=f"is a {kind} function"):
        oa.tool(name="numbers")(fn)


@pytest.mark.parametrize("kind", ["generator", "async generator"])
def test_a_sync_wrapper_returning_a_generator_is_refused_inside_the_call(kind: str) -> None:
    """A tool whose sync wrapper returns a generator (a decorator around a generator function)
    recorded the generator's repr as its result, and its body ran later, as the caller iterated,
    outside the agent (its memory write unrecorded). Refused with a TypeError inside the call,
    which records the error; the body never runs, and a retry re-raises the recorded error."""
    memory = oa.Memory("wrapped-generator")

    def numbers(n: int) -> Any:
        memory["ran"] = n
        yield from range(n)

    async def anumbers(n: int) -> Any:
        memory["ran"] = n
        yield n

    def wrap(fn: Callable[[int], Any]) -> Callable[[int], Any]:
        @functools.wraps(fn)
        def wrapper(n: int) -> Any:
            return fn(n)

        return wrapper

    tool = oa.tool(name="numbers")(wrap(numbers if kind == "generator" else anumbers))
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        with pytest.raises(TypeError, match=f"returned a {kind}"):
            tool.invoke("n-1", 2)
        with pytest.raises(TypeError, match=f"returned a {kind}"):
            tool.invoke("n-1", 2)
    assert memory.snapshot() == {}
    assert captured.of_type("tool_result") == []
    (error,) = captured.of_type("agent_error")
    assert error.payload["error_type"] == "TypeError"


def test_a_never_awaited_coroutine_of_a_sync_wrapper_releases_its_call() -> None:
    """The first call of a sync wrapper claims the invocation before its coroutine shows it is
    async; if that coroutine is dropped unawaited, the call ends as interrupted and a retry runs
    the body (it would otherwise wait forever for a body that never ran)."""
    ran: list[int] = []

    @oa.tool
    @_sync_wrapper
    async def echo(x: int) -> int:
        ran.append(x)
        return x

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the dropped coroutine's warning
        with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
            dropped = echo.invoke("e-1", 1)
            del dropped
            gc.collect()
            assert asyncio.run(asyncio.wait_for(echo.invoke("e-1", 1), 10)) == 1
    assert ran == [1]
    (interrupted,) = captured.of_type("agent_error")
    assert interrupted.payload["error_type"].endswith("CancelledError")
    assert [e.payload["result"] for e in captured.of_type("tool_result")] == [1]


def test_a_claim_that_finds_its_id_evicted_does_not_overwrite_another_threads_new_claim():
    """Two claims of one invocation id, one adding it without the lock while the other (which
    found the id present, then evicted before it took the lock) works under the lock: one owner,
    the other waits for it (the interleaving forced through the table's dict)."""
    from otel_agentcap.capture.tools import InvocationRegistry

    registry = InvocationRegistry()
    key = ("run", "agent", "x")
    first, _ = registry.claim(key, "t", "{}")
    registry.complete(key, first)
    table = first.table
    assert table is not None
    claims: list[tuple[object, bool]] = []

    class Interleaved(dict):  # type: ignore[type-arg]
        """setdefault: the id is evicted right after it is found; the next get: another thread
        claims the id (without the lock, as claim does for a new id)."""

        def setdefault(self, k: Any, default: Any = None) -> Any:
            found = super().setdefault(k, default)
            if found is not default and claims == []:
                del self[k]  # what _evict does, under the lock, between these two steps
                claims.append(("evicted", False))
            return found

        def get(self, k: Any, default: Any = None) -> Any:
            found = super().get(k, default)
            if claims == [("evicted", False)]:
                claims.append(registry.claim(key, "t", "{}"))
            return found

    table.by_id = Interleaved(table.by_id)
    own = registry.claim(key, "t", "{}")
    other = claims[1]
    assert [own[1], other[1]].count(True) == 1
    assert own[0] is other[0]


def test_a_keyword_named_like_a_positional_only_parameter_is_bound_to_kwargs():
    """f(a=2) of ``def f(a=0, /, **kw)`` is not recorded as a=2, the argument of f(2): under
    one invocation id the two are different calls, and the second runs. (How it is recorded is
    the full bind's: kw={'a': 2}, or args and kwargs where inspect refuses such a call.)"""

    @oa.tool
    def f(a: int = 0, /, **kw: int) -> list[Any]:
        return [a, kw]

    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        assert f.invoke("same", a=2) == [0, {"a": 2}]
        assert f.invoke("same", 2) == [2, {}]
    arguments = [e.payload["arguments"] for e in captured.of_type("tool_invocation")]
    assert arguments[0] in ({"kw": {"a": 2}}, {"args": [], "kwargs": {"a": 2}})
    assert arguments[1] == {"a": 2}


def test_a_claim_of_an_expired_call_still_in_the_table_runs_it_again():
    """A finished call older than the most recent max_completed, not yet evicted, is claimed
    anew: the caller owns a new entry, and the next claim of the same call waits for that one."""
    from otel_agentcap.capture.tools import InvocationRegistry

    registry = InvocationRegistry()
    key = ("run", "agent", "x")
    first, _ = registry.claim(key, "t", "{}")
    registry.complete(key, first)
    registry.max_completed = 0
    again, owned = registry.claim(key, "t", "{}")
    assert owned and again is not first
    assert registry.claim(key, "t", "{}") == (again, False)


def test_tool_span_attributes_keep_their_order_and_the_body_sees_them_all():
    """An execute_tool span ends with its stamp, payload and GenAI attributes in one fixed order;
    a span processor's on_start sees the event id and gen_ai.operation.name, and the body sees
    every attribute in that order."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor

    from otel_agentcap.pipeline.span_attributes import attributes_of

    at_start: list[list[str]] = []

    class Watch(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            if span.name == "execute_tool ordered":
                at_start.append(list(attributes_of(span)))

    in_body: list[list[str]] = []

    @oa.tool
    def ordered(x: int) -> int:
        in_body.append(list(attributes_of(trace.get_current_span())))
        return x

    with capture_events() as captured:
        # The global provider capture_events installs; Watch looks at this test's spans only.
        trace.get_tracer_provider().add_span_processor(Watch())  # type: ignore[attr-defined]
        with oa.run(_run_id()), oa.agent("alpha"):
            ordered.invoke("o-1", 1)
    span = next(s for s in captured.spans if s.name == "execute_tool ordered")
    stamp = [
        attr.RUN_ID,
        attr.AGENT_ID,
        attr.GEN_AI_AGENT_ID,
        attr.GEN_AI_AGENT_NAME,
        attr.EVENT_ID,
        attr.EVENT_TYPE,
        attr.EVENT_SEQ,
        attr.EVENT_IDEMPOTENCY_KEY,
        attr.GEN_AI_OPERATION_NAME,  # sampling-relevant in the GenAI conventions
    ]
    rest = [
        attr.EVENT_PAYLOAD,
        attr.GEN_AI_TOOL_NAME,
        attr.GEN_AI_TOOL_TYPE,
        attr.GEN_AI_TOOL_CALL_ID,
    ]
    assert at_start == [[attr.EVENT_ID, attr.GEN_AI_OPERATION_NAME]]
    assert in_body == [stamp + rest]
    assert list(span.attributes or {}) == [*stamp, *rest, attr.OUTCOME]


@settings(max_examples=40, deadline=None)
@given(
    distinct=st.integers(1, attr.MAX_CAUSAL_LINKS + 4),
    repeated=st.lists(st.integers(0, attr.MAX_CAUSAL_LINKS + 3), max_size=4),
    spanless=st.sets(st.integers(0, attr.MAX_CAUSAL_LINKS + 7), max_size=4),
    invocation_id=st.one_of(st.none(), st.just("c1")),
)
def test_a_call_under_caused_by_records_what_stamp_gives_for_its_parents(
    distinct: int, repeated: list[int], spanless: set[int], invocation_id: str | None
) -> None:
    """Under caused_by (parents repeated, without a span, more than MAX_CAUSAL_LINKS), each of
    two calls records the stamp, links and outcome record that stamp() gives for the same parents
    passed explicitly, on a clock at the same point."""

    @oa.tool
    def echo(x: int) -> int:
        return x

    memory = oa.Memory("m")
    with capture_events() as captured, oa.run(_run_id()), oa.agent("a"):
        pool = [memory.set(f"k{i}", i) for i in range(attr.MAX_CAUSAL_LINKS + 4)]
        order = list(range(distinct))
        for index in repeated:  # parents named twice
            order.insert(index % (len(order) + 1), index % distinct)
        refs = [pool[index] for index in order]
        parents = tuple(
            EventRef(ref.event_id, ref.seq, ref.agent_id) if position in spanless else ref
            for position, ref in enumerate(refs)
            if ref is not None
        )
        ctx = current_agent()
        assert ctx is not None
        clock_before: list[int] = []
        with oa.caused_by(*parents):
            for n in range(2):
                clock_before.append(ctx.clock.last)
                if invocation_id is None:
                    echo(n)
                else:
                    echo.invoke(invocation_id, n)  # the second: the id reused, other input
        reference = types.SimpleNamespace(
            run_id=ctx.run_id,
            agent_id=ctx.agent_id,
            name=ctx.name,
            event_id_prefix=ctx.event_id_prefix,
            clock=None,
        )
    spans = [s for s in captured.spans if s.name == "execute_tool echo"]
    assert len(spans) == 2
    for span, last in zip(spans, clock_before, strict=True):
        attributes = dict(span.attributes)
        reference.clock = LamportClock(ctx.run_id, ctx.agent_id)
        reference.clock.observe(last)
        start = stamp(
            reference,  # type: ignore[arg-type]
            EventType.TOOL_INVOCATION,
            key=attributes.get(attr.EVENT_IDEMPOTENCY_KEY),
            parents=parents,
        )
        stamped = list(start.attributes().items())
        assert list(attributes.items())[: len(stamped)] == stamped
        assert [(link.context, dict(link.attributes)) for link in span.links] == [
            (link.context, dict(link.attributes)) for link in start.links
        ]
        record = attributes[attr.OUTCOME]
        key = json.loads(record)["key"]
        reference.clock.observe(start.seq)
        done = stamp(
            reference,  # type: ignore[arg-type]
            EventType.TOOL_RESULT,
            key=None if key.startswith("seq:") else key,
            parents=(start.ref, *parents),
            link=False,
        )
        payload = record[record.index(',"payload":') + len(',"payload":') : -1]
        assert record == outcome_record(done, Encoded(payload))


def test_calls_under_one_caused_by_each_get_links_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two calls under one caused_by block: each span's link to the parent is its own, bounded by
    the provider's link limits for that span (with no link attribute allowed, each link counts
    its one dropped attribute)."""
    from opentelemetry import trace

    @oa.tool
    def echo(x: int) -> int:
        return x

    memory = oa.Memory("m")
    with capture_events() as captured, oa.run(_run_id()), oa.agent("a"):
        parent = memory.set("k", 1)
        assert parent is not None
        # The SDK provider's limits (a private attribute of opentelemetry-sdk 1.34 to 1.45).
        limits = trace.get_tracer_provider()._span_limits  # type: ignore[attr-defined]
        monkeypatch.setattr(limits, "max_link_attributes", 0)
        with oa.caused_by(parent):
            echo.invoke("c1", 1)
            echo(2)
    spans = [s for s in captured.spans if s.name == "execute_tool echo"]
    assert len(spans) == 2
    for span in spans:
        (link,) = span.links
        assert link.context == parent.span
        assert (dict(link.attributes), link.dropped_attributes) == ({}, 1)
