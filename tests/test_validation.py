"""validation: the rules every record meets before it reaches SQL."""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

import otel_agentcap as ac
from otel_agentcap.clock import LamportClock
from otel_agentcap.model import AgentRecord, Event, RunRecord, event_id_for
from otel_agentcap.pipeline.mapping import batch_from_spans
from otel_agentcap.testing import capture_events
from otel_agentcap.validation import (
    SEQUENCE_CEILING,
    SEQUENCE_CLOCK_ALLOWANCE,
    Validator,
    max_sequence,
)

NOW = datetime.now(UTC)
ids = st.text(
    st.characters(blacklist_characters="\x00\x1f", blacklist_categories=("Cs",)), min_size=1
).filter(lambda s: s.strip() and len(s.encode()) <= 512)


def _event(run: str = "r", agent: str = "a", key: str = "k", **changes: object) -> Event:
    event = Event(event_id_for(run, agent, key), run, agent, 1, "memory_write", key, NOW)
    return event._replace(**changes)


def test_everything_the_capture_api_records_is_valid():
    """Every event, agent row and run row of a captured program (spawns, tools, memory, errors)
    passes validation: the rules refuse nothing capture makes."""
    memory = ac.Memory("m")

    @ac.tool
    def fails() -> None:
        raise ValueError("no")

    with capture_events() as captured, ac.run("run-valid", who="me"), ac.agent("root") as root:
        memory["k"] = 1
        child = root.spawn("child", key="c")
        child.run(lambda: memory.get("k"))
        with contextlib.suppress(ValueError):
            fails.invoke("inv-1")
    batch = batch_from_spans(captured.spans)
    validator = Validator()
    assert not batch.rejected
    assert [validator.event(e) for e in batch.events] == [None] * len(batch.events)
    assert [validator.agent(a) for a in batch.agents] == [None] * len(batch.agents)
    assert [validator.run(r) for r in batch.runs] == [None] * len(batch.runs)
    assert any(a.lineage_known and a.parent_agent_id == "root" for a in batch.agents)


@given(ids, ids, ids, ids)
def test_an_event_id_must_be_that_of_its_run_agent_and_key(run, agent, key, other):
    """An event id is accepted only when it is uuid5 of the event's own run, agent and key."""
    validator = Validator()
    assert validator.event(_event(run, agent, key)) is None
    if other != run:
        moved = _event(run, agent, key)._replace(run_id=other)
        assert validator.event(moved) is not None
    if other != key:
        assert validator.event(_event(run, agent, key, event_id=event_id_for(run, agent, other)))


def test_sequences_of_a_clock_that_lost_the_database_are_accepted():
    """A clock whose sequence source fails continues from a wall-clock floor; its sequences are
    inside the accepted range, far below the ceiling."""

    class Down:
        def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
            raise ConnectionError("down")

    clock = LamportClock("r", "a", source=Down())
    seqs = [clock.tick() for _ in range(3)]
    validator = Validator()
    for seq in seqs:
        assert validator.event(_event(seq=seq)) is None
    assert max(seqs) < validator.max_seq < SEQUENCE_CEILING


def test_sequences_out_of_range_or_of_another_type_are_rejected():
    """Negative sequences, sequences past the clock allowance, 2**63 - 1, booleans and strings
    are rejected; the bound moves with the clock and never passes the ceiling."""
    validator = Validator()
    bound = validator.max_seq
    for seq in (-1, bound + 1, 2**63 - 1, True, "5", 5.0):
        assert validator.event(_event(seq=seq)) is not None, seq
    assert validator.event(_event(seq=bound)) is None
    later = time.time_ns() + 10**9
    assert max_sequence(later) == later // 1000 + SEQUENCE_CLOCK_ALLOWANCE
    assert max_sequence(2**100) == SEQUENCE_CEILING


def test_times_types_keys_and_parents_are_checked():
    """Unset (epoch) and far-future times, unknown event types, empty or NUL keys, and parent ids
    that are not UUIDs are rejected."""
    validator = Validator()
    bad = [
        _event(wall_time=datetime(1970, 1, 1, tzinfo=UTC)),
        _event(wall_time=NOW + timedelta(days=400)),
        _event(wall_time=datetime(2025, 1, 1)),  # naive
        _event(event_type="telepathy"),
        _event(key="", event_id=event_id_for("r", "a", "")),
        _event(key="a\x00b", event_id=event_id_for("r", "a", "a\x00b")),
        _event(causal_parent_ids=("not-a-uuid",)),
        _event(run="", event_id=event_id_for("", "a", "k")),
    ]
    assert all(validator.event(e) is not None for e in bad)


def test_spawn_links_must_name_the_parents_spawn_event():
    """A child's lineage is accepted only with the id of its parent's agent_spawn event for it; a
    root has no spawn link; an unknown lineage carries no parent."""
    validator = Validator()
    link = event_id_for("r", "parent", "spawn:child")
    assert validator.agent(AgentRecord("r", "child", "c", "parent", link, True)) is None
    assert validator.agent(AgentRecord("r", "root", "root", None, None, True)) is None
    assert validator.agent(AgentRecord("r", "child", "c", "parent", link, False)) is not None
    assert validator.agent(AgentRecord("r", "child", "c", "other", link, True)) is not None
    assert validator.agent(AgentRecord("r", "child", "c", "child", link, True)) is not None
    assert validator.agent(AgentRecord("r", "root", "root", None, link, True)) is not None
    assert validator.run(RunRecord("r", datetime(1970, 1, 1, tzinfo=UTC))) is not None
    assert validator.run(RunRecord("", NOW)) is not None
