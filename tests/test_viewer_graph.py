"""The web view's pure layout: lanes in spawn-tree order, events by sequence, parents as indexes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.exporters.postgres.store import ConflictRow, GraphRow
from otel_agentcap.model import AgentRecord
from otel_agentcap.viewer.graph import lane_order, run_graph_document
from otel_agentcap.viewer.labels import MAX_LABEL, label


def _id(n: int) -> str:
    return str(uuid.UUID(int=n + 1))


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[AgentRecord], list[GraphRow]]:
    """A spawn tree (or forest) of agents, each with events; parents point at earlier events,
    some across agents, some at ids that are not stored."""
    count = draw(st.integers(1, 7))
    agents: list[AgentRecord] = []
    rows: list[GraphRow] = []
    seq_of: dict[str, int] = {}
    n = 0
    for a in range(count):
        parent = draw(st.sampled_from([None, *range(a)])) if a else None
        agent_id = f"agent{a}"
        spawn = None
        start = 1
        if parent is not None:
            parent_rows = [r for r in rows if r.agent_id == f"agent{parent}"]
            spawn_row = draw(st.sampled_from(parent_rows))
            spawn = spawn_row.event_id
            start = spawn_row.seq + 1
        agents.append(
            AgentRecord(
                "r", agent_id, f"n{a}", f"agent{parent}" if parent is not None else None, spawn
            )
        )
        seq = start
        for _ in range(draw(st.integers(1, 6))):
            earlier = [r.event_id for r in rows if r.seq < seq]
            parents = draw(st.lists(st.sampled_from(earlier), max_size=3)) if earlier else []
            if draw(st.booleans()) and n % 5 == 0:
                parents.append(_id(10_000 + n))  # not stored
            event_id = _id(n)
            n += 1
            rows.append(GraphRow(event_id, agent_id, seq, "memory_read", tuple(parents)))
            seq_of[event_id] = seq
            seq += draw(st.integers(1, 3))
    draw(st.randoms()).shuffle(rows)
    return agents, rows


@settings(max_examples=200, deadline=None)
@given(runs())
def test_document_keeps_every_event_parent_and_spawn(run):
    """Every event once, lanes contiguous and in sequence order, each child lane after its
    parent's (deeper by one), columns by sequence, parents resolved or listed as missing."""
    agents, rows = run
    doc = run_graph_document(agents, rows, with_ids=True)
    lanes = [lane["agent"] for lane in doc["lanes"]]
    assert sorted(lanes) == sorted(a.agent_id for a in agents)
    depth = {lane["agent"]: lane["depth"] for lane in doc["lanes"]}
    for record in agents:
        if record.parent_agent_id is not None:
            assert lanes.index(record.parent_agent_id) < lanes.index(record.agent_id)
            assert depth[record.agent_id] == depth[record.parent_agent_id] + 1
            between = lanes[lanes.index(record.parent_agent_id) + 1 : lanes.index(record.agent_id)]
            assert all(depth[a] > depth[record.parent_agent_id] for a in between)
    by_id = {r.event_id: r for r in rows}
    ids = doc["id"]
    assert sorted(ids) == sorted(by_id)
    places = [(doc["lane"][i], doc["col"][i]) for i in range(len(ids))]
    assert places == sorted(places) and len(set(places)) == len(places)
    for i, event_id in enumerate(ids):
        row = by_id[event_id]
        assert lanes[doc["lane"][i]] == row.agent_id
        assert doc["seqs"][doc["col"][i]] == row.seq
        got = [ids[p] for p in doc["parents"][doc["pstart"][i] : doc["pstart"][i + 1]]]
        missing = [pid for j, pid in doc["missing"] if j == i]
        assert got == [p for p in dict.fromkeys(row.causal_parent_ids) if p in by_id]
        assert missing == [p for p in row.causal_parent_ids if p not in by_id]
    assert doc["seqs"] == sorted(set(r.seq for r in rows))
    for lane in doc["lanes"]:
        record = next(a for a in agents if a.agent_id == lane["agent"])
        if record.spawned_at_event_id is not None:
            assert ids[lane["spawn"]] == record.spawned_at_event_id


def test_siblings_follow_their_spawns_and_cycles_end():
    """Siblings are ordered by the sequence of their spawn event; a parent cycle in bad data
    still gives every agent one lane."""
    agents = [
        AgentRecord("r", "p"),
        AgentRecord("r", "p/late", parent_agent_id="p"),
        AgentRecord("r", "p/early", parent_agent_id="p"),
        AgentRecord("r", "x", parent_agent_id="y"),
        AgentRecord("r", "y", parent_agent_id="x"),
    ]
    order = lane_order(agents, {}, {"p/late": 9, "p/early": 3})
    assert [a.agent_id for a, _ in order][:3] == ["p", "p/early", "p/late"]
    assert sorted(a.agent_id for a, _ in order) == sorted(a.agent_id for a in agents)


def test_moved_parents_and_conflicts_are_placed():
    """A parent id kept in conflicts resolves to the stored event; a conflict is placed at its
    own lane and sequence with the index of the event it collided with."""
    rows = [
        GraphRow(_id(1), "a", 1, "model_call", ()),
        GraphRow(_id(2), "a", 2, "tool_invocation", (_id(99),)),
    ]
    conflict = ConflictRow(
        7,
        datetime.now(UTC),
        "event_id_content",
        _id(1),
        _id(1),
        "b",
        5,
        "model_call",
        datetime.now(UTC),
        (),
        "seq:5",
        None,
        None,
    )
    doc = run_graph_document([], rows, [conflict], {_id(99): _id(1)})
    assert doc["parents"] == [0] and doc["missing"] == []
    assert [lane["agent"] for lane in doc["lanes"]] == ["a", "b"]
    assert doc["conflicts"][0] | {"detected_at": ""} == {
        "id": 7,
        "reason": "event_id_content",
        "existing": 0,
        "lane": 1,
        "col": 2,
        "type": "model_call",
        "event_id": _id(1),
        "detected_at": "",
    }
    assert doc["seqs"] == [1, 2, 5]
    assert run_graph_document([], [GraphRow(_id(1), "a", 2**60, "x", ())])["seqs"] == [str(2**60)]


@given(
    st.sampled_from(["model_call", "tool_result", "memory_write", "agent_error", "agent_spawn"]),
    st.dictionaries(
        st.sampled_from(
            [
                "tool",
                "key",
                "model",
                "error_type",
                "message",
                "child_agent_id",
                "input_tokens",
                "status",
            ]
        ),
        st.text(max_size=400),
    ),
)
def test_labels_are_one_short_line(kind, fields):
    """A label is at most MAX_LABEL characters and one line, whatever the payload holds."""
    text = label(kind, fields, "agent")
    assert len(text) <= MAX_LABEL and "\n" not in text


def test_label_examples():
    """Labels name the model and tokens, the tool, the key, the error and the spawned child."""
    assert (
        label(
            "model_call",
            {"model": "claude-x", "input_tokens": "5", "output_tokens": "2", "tool_uses": 1},
        )
        == "x 5/2 +1 tool_use"
    )
    assert label("tool_result", {"tool": "search"}) == "search"
    assert label("memory_write", {"key": "k", "op": "delete"}) == "del k"
    assert label("agent_error", {"error_type": "a.b.Timeout", "timed_out": "true"}) == (
        "timed out (Timeout)"
    )
    assert label("agent_spawn", {"child_agent_id": "p/c"}, "p") == "c"
