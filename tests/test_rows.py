"""rows: the staged rows of a batch, built for the binary COPY."""

from __future__ import annotations

import struct
import uuid
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.exporters.postgres.rows import prepare
from otel_agentcap.model import EVENT_TYPES, Batch, Event, event_id_for

NOW = datetime.now(UTC).replace(microsecond=0)
OTHER_IDS = [str(uuid.UUID(int=n)) for n in (1, 2)]


def _uuid_array(values: tuple[str, ...] | list[str]) -> bytes:
    """Binary uuid[] as PostgreSQL documents it: dimensions, flags, element type, then per
    dimension its length and lower bound, then each element's length and bytes."""
    if not values:
        return struct.pack("!iiI", 0, 0, 2950)
    head = struct.pack("!iiIii", 1, 0, 2950, len(values), 1)
    return head + b"".join(struct.pack("!i", 16) + uuid.UUID(v).bytes for v in values)


def _clean(value: str) -> str:
    return value.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


@st.composite
def batches(draw: st.DrawFn) -> list[Event]:
    """Valid events of two agents whose causal parents are earlier or later events of the batch,
    events of no batch (canonical, uppercase or unhyphenated text) or none."""
    count = draw(st.integers(1, 8))
    keys = draw(
        st.lists(
            st.sampled_from(["k", "ké", "key"]).map(lambda k: k + "-"),
            min_size=count,
            max_size=count,
        )
    )
    agents = draw(st.lists(st.sampled_from(["a", "b"]), min_size=count, max_size=count))
    ids = [
        event_id_for("r", agent, f"{key}{i}")
        for i, (agent, key) in enumerate(zip(agents, keys, strict=True))
    ]
    known = ids + OTHER_IDS
    parent = st.sampled_from(known).flatmap(
        lambda v: st.sampled_from([v, v.upper(), v.replace("-", "")])
    )
    events = []
    for i, (agent, key) in enumerate(zip(agents, keys, strict=True)):
        parents = draw(st.lists(parent, max_size=3))
        events.append(
            Event(
                ids[i],
                "r",
                agent,
                i,
                draw(st.sampled_from(sorted(EVENT_TYPES))),
                f"{key}{i}",
                draw(st.sampled_from([NOW, NOW.astimezone(timezone(timedelta(hours=3)))])),
                tuple(parents) if draw(st.booleans()) else parents,
                draw(st.sampled_from([None, {"v": i}])),
                draw(st.sampled_from([None, "0" * 32])),
                draw(st.sampled_from([None, "s" * 16, "s\x00", "s\ud800"])),
            )
        )
    return events


@settings(max_examples=300)
@given(batches())
def test_rows_hold_each_events_fields_as_the_copy_sends_them(events):
    """Each row holds its event's id and causal parents as binary UUIDs and uuid[] (whatever
    text form a parent has, whether or not it is an event of the batch), its texts with NUL and
    lone surrogates escaped, its time aware, its payload; rows in (run, agent, seq) order."""
    prepared = prepare(Batch(tuple(events)))
    assert not prepared.rejected
    by_id = {uuid.UUID(e.event_id).bytes: e for e in events}
    assert [(r.run_id, r.agent_id, r.logical_seq) for r in prepared.events] == sorted(
        (e.run_id, e.agent_id, e.seq) for e in events
    )
    for row in prepared.events:
        event = by_id[row.event_id]
        assert row.causal_parent_ids == _uuid_array(event.causal_parent_ids)
        assert row[1:6] == (
            event.run_id,
            event.agent_id,
            event.seq,
            event.wall_time,
            event.event_type,
        )
        assert row.wall_time.tzinfo is not None
        assert row.idempotency_key == _clean(event.idempotency_key)
        assert row.trace_id == event.trace_id
        assert row.span_id == (None if event.span_id is None else _clean(event.span_id))
        assert (row.payload and row.payload.obj) == event.payload
        assert (row.batch_reason, row.batch_conflict_with) == (None, None)
