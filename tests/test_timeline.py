"""timeline: what show prints, computed from events alone."""

from __future__ import annotations

import uuid
from dataclasses import asdict, fields
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otel_agentcap.cli.timeline import Totals, event_positions, parent_text, totals
from otel_agentcap.model import Event

_NOW = datetime(2026, 1, 1, tzinfo=UTC)

_payloads = {
    "model_call": st.fixed_dictionaries(
        {
            "status": st.sampled_from(["ok", "error", "unset"]),
            "usage": st.fixed_dictionaries(
                {},
                optional={
                    "input_tokens": st.integers(0, 10_000),
                    "output_tokens": st.integers(0, 10_000),
                    "cache_read_input_tokens": st.integers(0, 10_000),
                    "cache_creation_input_tokens": st.integers(0, 10_000),
                },
            ),
        },
        optional={"latency_ms": st.floats(0, 60_000)},
    ),
    "tool_invocation": st.just({"tool": "t", "invocation_id": "i", "arguments": {}}),
    "tool_result": st.just({"tool": "t", "invocation_id": "i", "result": 1}),
    "agent_error": st.one_of(
        st.just({"error_type": "ValueError", "message": "m", "invocation_id": "i", "tool": "t"}),
        st.just({"error_type": "TimeoutError", "message": "m", "timed_out": True}),
    ),
    "memory_read": st.just({"memory": "m", "key": "k", "found": True}),
    "agent_spawn": st.just({"child_agent_id": "c"}),
}


@st.composite
def _events(draw: st.DrawFn) -> list[Event]:
    events = []
    for seq, kind in enumerate(draw(st.lists(st.sampled_from(sorted(_payloads)), max_size=40))):
        events.append(
            Event(
                event_id=str(uuid.uuid4()),
                run_id="r",
                agent_id=draw(st.sampled_from(["planner", "planner/a", "planner/b"])),
                seq=seq + 1,
                event_type=kind,
                idempotency_key=f"seq:{seq + 1}",
                wall_time=_NOW,
                payload=draw(_payloads[kind]),
            )
        )
    return events


@given(_events(), st.dictionaries(st.sampled_from(["planner", "gone"]), st.integers(0, 5)))
def test_run_totals_are_the_sum_of_the_agent_totals(events, conflicts):
    """Every count of the run is the sum of its agents' counts, conflicts included."""
    run, agents = totals(events, conflicts)
    for field in fields(Totals):
        summed = sum(getattr(t, field.name) for t in agents.values())
        if isinstance(summed, float):  # latencies: the same sum in another order
            assert getattr(run, field.name) == pytest.approx(summed, rel=1e-12)
        else:
            assert getattr(run, field.name) == summed
    assert run.events == len(events)
    assert run.conflicts == sum(conflicts.values())


@given(_events())
def test_tool_failures_are_the_agent_errors_that_name_an_invocation(events):
    """A tool's error counts as a tool failure, any other agent_error as the agent's error."""
    run, _ = totals(events)
    errors = [e for e in events if e.event_type == "agent_error"]
    assert run.tool_failures == sum("invocation_id" in e.payload for e in errors)
    assert run.agent_errors == len(errors) - run.tool_failures
    calls = [e for e in events if e.event_type == "model_call"]
    assert run.input_tokens == sum(e.payload["usage"].get("input_tokens", 0) for e in calls)
    assert run.model_call_errors == sum(e.payload["status"] == "error" for e in calls)


def test_parents_are_named_by_agent_and_sequence():
    """A parent in another agent is agent#seq (also one found elsewhere), one in the event's
    own agent #seq, an unknown id its prefix."""
    first = Event(str(uuid.uuid4()), "r", "planner", 3, "tool_result", "k", _NOW)
    elsewhere = str(uuid.uuid4())
    unknown = str(uuid.uuid4())
    child = first._replace(
        event_id=str(uuid.uuid4()),
        agent_id="planner/a",
        seq=9,
        causal_parent_ids=(first.event_id, elsewhere, unknown),
    )
    own = first._replace(event_id=str(uuid.uuid4()), agent_id="planner/a", seq=7)
    child = child._replace(causal_parent_ids=(*child.causal_parent_ids, own.event_id))
    positions = event_positions([first, child, own], {elsewhere: ("planner/b", 4)})
    assert parent_text(child, positions) == (
        f"<- planner#3, planner/b#4, {unknown[:8]} (not stored), #7"
    )
    assert parent_text(first, positions) == ""
    assert asdict(totals([])[0]) == asdict(Totals())
