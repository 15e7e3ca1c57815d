"""Bad input and misuse: a clear error or a recorded, safe value, and nothing captured is lost."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import uuid

import pytest

import otel_agentcap as oa
from otel_agentcap.context import current_agent
from otel_agentcap.testing import capture_events


def _run_id() -> str:
    return f"bad-{uuid.uuid4().hex[:12]}"


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")

    def __repr__(self) -> str:
        return "Unprintable()"


def _types(events: list[oa.Event]) -> list[str]:
    return [event.event_type for event in events]


def test_an_error_whose_str_raises_costs_no_event():
    @oa.tool
    def broken() -> None:
        raise UnprintableError()

    with (
        capture_events() as captured,
        oa.run(_run_id()),
        pytest.raises(UnprintableError),
        oa.agent("planner"),
    ):
        with pytest.raises(UnprintableError):
            broken.invoke("call-1")
        raise UnprintableError()
    assert _types(captured.events) == [
        "agent_start",
        "tool_invocation",
        "agent_error",
        "agent_error",
    ]
    error = captured.events[2].payload
    assert error["error_type"].endswith("UnprintableError") and error["message"]


def test_state_keys_that_cannot_be_printed_leave_the_users_error_and_unbind_the_agent():
    with capture_events() as captured, oa.run(_run_id()):
        with pytest.raises(ValueError, match="user error"), oa.agent("planner") as execution:
            execution.state[Unprintable()] = 1
            raise ValueError("user error")
        assert current_agent() is None
    rollback = captured.events[-1]
    assert rollback.event_type == "agent_error"
    assert rollback.payload["discarded_state_keys"] == ["<Unprintable>"]


def test_state_replaced_by_a_non_dict_leaves_the_users_error():
    with oa.run(_run_id()):
        with pytest.raises(ValueError, match="user error"), oa.agent("planner") as execution:
            execution.state = None  # type: ignore[assignment]
            raise ValueError("user error")
        assert current_agent() is None


def test_state_that_cannot_be_copied_fails_where_it_is_committed():
    """The block that stores it gets a clear TypeError; the agent keeps its last good state and
    its next execution works."""
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("planner") as execution:
            execution.state["plan"] = ["a"]
        with (
            pytest.raises(TypeError, match=r"cannot be committed.*deepcopy"),
            oa.agent("planner") as execution,
        ):
            execution.state["lock"] = threading.Lock()
        with oa.agent("planner") as execution:
            assert execution.state == {"plan": ["a"]}
    assert _types(captured.events) == [
        "agent_start",
        "agent_end",
        "agent_start",
        "agent_error",
        "agent_start",
        "agent_end",
    ]


def test_committed_state_is_a_copy_of_the_blocks_state():
    with oa.run(_run_id()):
        with oa.agent("planner") as execution:
            execution.state["plan"] = ["a"]
            kept = execution.state
        kept["plan"].append("changed after the block")
        with oa.agent("planner") as execution:
            assert execution.state == {"plan": ["a"]}


def test_an_agent_scope_closed_in_another_context_does_not_raise():
    """A generator that holds an agent scope may be closed by a framework in another context."""
    run_id = _run_id()

    def stream():
        with oa.run(run_id), oa.agent("streamer"):
            yield 1
            yield 2

    with capture_events() as captured:
        generator = stream()
        contextvars.copy_context().run(next, generator)
        generator.close()
    assert _types(captured.events) == ["agent_start", "agent_error"]
    assert captured.events[-1].payload["error_type"] == "GeneratorExit"


class PrefixedError(Exception):
    constructed = 0

    def __init__(self, code: int) -> None:
        PrefixedError.constructed += 1
        super().__init__(f"HTTP error: {code}")


def test_a_replayed_error_is_the_recorded_one_without_running_its_init_again():
    @oa.tool
    def fetch(code: int) -> None:
        raise PrefixedError(code)

    PrefixedError.constructed = 0
    with oa.run(_run_id()), oa.agent("planner"):
        messages = []
        for _ in range(3):
            with pytest.raises(PrefixedError) as raised:
                fetch.invoke("call-1", 404)
            messages.append(str(raised.value))
    assert messages == ["HTTP error: 404"] * 3
    assert PrefixedError.constructed == 1


def test_replayed_builtin_errors_keep_their_fields():
    @oa.tool
    def open_file(name: str) -> None:
        raise FileNotFoundError(2, "No such file", name)

    with oa.run(_run_id()), oa.agent("planner"):
        for _ in range(2):
            with pytest.raises(FileNotFoundError) as raised:
                open_file.invoke("call-1", "notes.txt")
            assert (raised.value.errno, raised.value.filename) == (2, "notes.txt")


@pytest.mark.timeout(20)
def test_a_tool_invoked_inside_itself_with_its_own_id_is_an_error_not_a_hang():
    """The same call (id and input) inside its own body raises instead of waiting for itself; the
    same id with other input is another call and runs."""

    @oa.tool
    def recurse(depth: int) -> int:
        return recurse.invoke("same", depth)

    @oa.tool
    def deeper(depth: int) -> int:
        return depth if depth else deeper.invoke("same", depth + 1)

    with oa.run(_run_id()), oa.agent("planner"):
        with pytest.raises(RuntimeError, match="already running"):
            recurse.invoke("same", 0)
        with pytest.raises(RuntimeError, match="already running"):
            recurse.invoke("same", 0)  # the recorded outcome is that error
        assert deeper.invoke("same", 0) == 1


@pytest.mark.timeout(20)
def test_an_async_tool_invoked_inside_itself_with_its_own_id_is_an_error_not_a_hang():
    @oa.tool
    async def recurse(depth: int) -> int:
        return await recurse.invoke("same", depth)

    async def main() -> None:
        with oa.run(_run_id()):
            async with oa.agent("planner"):
                with pytest.raises(RuntimeError, match="already running"):
                    await recurse.invoke("same", 0)

    asyncio.run(main())


def test_a_callable_without_a_name_needs_one():
    import functools

    def add(a: int, b: int) -> int:
        return a + b

    with pytest.raises(TypeError, match=r"tool\(name=\.\.\.\)"):
        oa.tool(functools.partial(add, 1))
    named = oa.tool(name="add_one")(functools.partial(add, 1))
    with oa.run(_run_id()), oa.agent("planner"):
        assert named.invoke("call-1", 2) == 3


def test_tool_use_blocks_whose_ids_cannot_be_invocation_ids_still_run():
    """A block without an id, or with one no invocation id may be (U+001F, over 512 bytes), runs
    its tool as a plain captured call; two blocks without ids are two runs, not a retry."""
    calls: list[int] = []

    @oa.tool
    def count(n: int) -> int:
        calls.append(n)
        return n

    message = {
        "content": [
            {"type": "tool_use", "name": "count", "input": {"n": 1}},
            {"type": "tool_use", "name": "count", "input": {"n": 2}},
            {"type": "tool_use", "id": "toolu_\x1f", "name": "count", "input": {"n": 3}},
            {"type": "tool_use", "id": "toolu_" + "x" * 600, "name": "count", "input": {"n": 4}},
        ]
    }
    with oa.run(_run_id()), oa.agent("planner"):
        results = oa.run_tool_uses(message, [count])
    assert calls == [1, 2, 3, 4]
    assert [r["content"] for r in results] == ["1", "2", "3", "4"]
    assert not any(r.get("is_error") for r in results)
