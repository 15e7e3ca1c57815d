"""Bad input and misuse: a clear error or a recorded, safe value, and nothing captured is lost."""

from __future__ import annotations

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
