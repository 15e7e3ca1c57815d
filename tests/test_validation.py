"""validation: the rules every record meets before it reaches SQL."""

from __future__ import annotations

import contextlib
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given, settings
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


ANY_ID = str(uuid.UUID(int=7))
OWN_ID = event_id_for("r", "a", "k")
#: Values that break (or, at a boundary, just keep) one rule of the field they replace.
EDGES: dict[str, list[object]] = {
    "event_id": [
        ANY_ID,
        OWN_ID.upper(),
        "{" + OWN_ID + "}",
        OWN_ID.replace("-", ""),
        uuid.UUID(OWN_ID),
    ],
    "run_id": ["r2", "", "r\x00", "r\ud800"],
    "agent_id": ["a2", "", "a\x1f"],
    "seq": [-1, 0, 5.0, "5", True, 2**62, 2**63, 2**100],
    "event_type": ["model_call", "telepathy", "Memory_write"],
    "idempotency_key": ["k2", "ké", "k\x00", "k\ud800", "", "k" * 1024, "k" * 1025],
    "wall_time": [
        datetime(2025, 1, 1),
        datetime(1999, 12, 31, 23, 59, tzinfo=UTC),
        datetime(2000, 1, 1, tzinfo=UTC),
        NOW + timedelta(days=365),
        NOW + timedelta(days=400),
        NOW.astimezone(timezone(timedelta(hours=-5))),
    ],
    "causal_parent_ids": [
        (),
        [ANY_ID],
        (ANY_ID.upper(),),
        (ANY_ID, "{" + ANY_ID + "}"),
        (ANY_ID.replace("-", ""),),
        (ANY_ID[1:],),
        (uuid.UUID(ANY_ID),),
        (ANY_ID,) * 10_000,
        (ANY_ID,) * 10_001,
        (OWN_ID,),
        (OWN_ID, ANY_ID[1:]),
        (OWN_ID.upper(),),
    ],
    "payload": [{"a": 1}],
    "trace_id": [None, "t" * 128, "t" * 129, "t\x00"],
    "span_id": [None, "s" * 128, "s" * 129, "s\ud800"],
}
#: Values of any type, for any field.
odd = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.just(uuid.UUID(int=7)),
    st.just(b"k"),
    st.lists(st.text(max_size=2), max_size=2),
)
one_change = st.sampled_from(Event._fields).flatmap(
    lambda name: st.tuples(st.just(name), st.sampled_from(EDGES[name]) | odd)
)


def _both_checks(changes: dict[str, object], meet_first: bool) -> list[object]:
    """What ``event_reason`` and ``event`` say of a valid event with ``changes`` (its id made
    that of its run, agent and key again, unless the id is changed)."""
    event = Event(
        OWN_ID, "r", "a", 3, "memory_write", "k", NOW, (ANY_ID,), None, "0" * 32, "0" * 16
    )
    event = event._replace(**changes)
    if "event_id" not in changes:
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            event = event._replace(
                event_id=event_id_for(event.run_id, event.agent_id, event.idempotency_key)
            )
    validator = Validator()
    if meet_first:
        assert validator.event(_event()) is None
    outcomes = []
    for check in (validator.event_reason, validator.event):
        try:
            outcomes.append(check(event))
        except Exception as exc:
            outcomes.append(repr(exc))
    return outcomes


def test_the_fast_path_gives_the_reason_of_the_rules_as_written_at_every_edge():
    """For a valid event with any one field set to a value at or past one of its rules' edges,
    ``Validator.event`` (with its inline check of the common case) gives what
    ``Validator.event_reason`` (the rules as written) gives."""
    for name, values in EDGES.items():
        for value in values:
            for meet_first in (True, False):
                first, second = _both_checks({name: value}, meet_first)
                assert first == second, (name, value)


@settings(max_examples=500)
@given(st.lists(one_change, max_size=3), st.booleans())
def test_the_fast_path_gives_the_reason_of_the_rules_as_written(changes, meet_first):
    """For any event (fields of any type, several rules broken at once), ``Validator.event``
    gives what ``Validator.event_reason`` gives."""
    first, second = _both_checks(dict(changes), meet_first)
    assert first == second
