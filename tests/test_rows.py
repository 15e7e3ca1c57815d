"""rows: the staged rows of a batch, built for the binary COPY."""

from __future__ import annotations

import json
import struct
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap import jsonsafe
from otel_agentcap.exporters.postgres.rows import (
    DeferredRows,
    copy_data,
    payload_dumps,
    prepare,
    span_copy_data,
    span_row_runs,
)
from otel_agentcap.model import EVENT_TYPES, Batch, Event, SpanRecord, event_id_for

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


def _tuples(data: bytes) -> list[list[bytes | None]]:
    """The tuples of binary COPY data (signature, flags and header extension first, no
    trailer), each field's bytes or None for NULL."""
    assert data[:11] == b"PGCOPY\n\xff\r\n\x00"
    (extension,) = struct.unpack_from("!i", data, 15)
    offset = 19 + extension
    tuples = []
    while offset < len(data):
        (count,) = struct.unpack_from("!h", data, offset)
        offset += 2
        fields: list[bytes | None] = []
        for _ in range(count):
            (size,) = struct.unpack_from("!i", data, offset)
            offset += 4
            fields.append(None if size < 0 else data[offset : offset + size])
            offset += max(size, 0)
        tuples.append(fields)
    return tuples


def _micros(value: datetime) -> bytes:
    return struct.pack(
        "!q", (value - datetime(2000, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    )


def _text(value: str | None) -> bytes | None:
    return None if value is None else value.encode()


@settings(max_examples=200)
@given(batches(), st.booleans())
def test_copy_data_sends_each_row_field_by_field(events, staging):
    """The binary COPY of the rows holds one tuple per row with each column in order: ids as
    16 bytes, texts as UTF-8, sequence and times as int8 (microseconds since 2000), parents as
    the row's uuid[], the payload as jsonb version 1, the run's start last."""
    prepared = prepare(Batch(tuple(events)))
    start = NOW - timedelta(hours=1)
    tuples = _tuples(copy_data(prepared.events, staging=staging, starts={"r": start}))
    assert len(tuples) == len(prepared.events)
    for row, fields in zip(prepared.events, tuples, strict=True):
        payload = None if row.payload is None else b"\x01" + json.dumps(row.payload.obj).encode()
        expected = [
            row.event_id,
            b"r",
            row.agent_id.encode(),
            struct.pack("!q", row.logical_seq),
            _micros(row.wall_time),
            row.event_type.encode(),
            row.causal_parent_ids,
            row.idempotency_key.encode(),
            _text(row.trace_id),
            _text(row.span_id),
            payload and payload.replace(b" ", b""),
        ]
        if staging:
            expected += [None, None]
        assert fields == [*expected, _micros(start)]


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["s1", "s2", "s\x00", "s\ud800"]),
            st.sampled_from([None, "s1", "p"]),
            st.integers(0, 4),
            st.integers(0, 10**6),
            st.sampled_from([None, "message", "m\ud800"]),
        ),
        max_size=6,
    )
)
def test_span_copy_data_sends_each_span_field_by_field(spans):
    """The binary COPY of span envelopes holds one tuple per distinct span (its first record),
    sorted, every column in the order of agentcap.spans: texts as UTF-8 (NUL and lone
    surrogates escaped), kind and status code as int2, start and end as int8 microseconds since
    2000, the run's start last."""
    records = tuple(
        SpanRecord(
            "r",
            "0" * 32,
            span_id,
            parent,
            "name",
            kind,
            NOW,
            NOW + timedelta(microseconds=length),
            kind % 3,
            message,
            "service",
            None,
        )
        for span_id, parent, kind, length, message in spans
    )
    prepared = prepare(Batch(spans=records))
    start = NOW - timedelta(hours=1)
    tuples = _tuples(span_copy_data(prepared.spans, starts={"r": start}))
    assert len(tuples) == len(prepared.spans) == len({s.span_id for s in records})
    assert [row[2] for row in prepared.spans] == sorted({_clean(s.span_id) for s in records})
    for row, fields in zip(prepared.spans, tuples, strict=True):
        first = next(s for s in records if _clean(s.span_id) == row[2])
        assert fields == [
            b"r",
            b"0" * 32,
            _clean(first.span_id).encode(),
            _text(first.parent_span_id),
            b"name",
            struct.pack("!h", first.kind),
            _micros(first.start_time),
            _micros(first.end_time),
            struct.pack("!h", first.status_code),
            _text(None if first.status_message is None else _clean(first.status_message)),
            b"service",
            None,
            _micros(start),
        ]


def test_raw_payload_text_over_the_limit_that_is_not_json_is_stored_as_its_marker():
    """Payload text kept unparsed (``RawJson``) that is over the limit and not JSON (cut, say)
    is encoded as the general path encodes it parsed (its ``$agentcap.unparsed`` marker, cut
    to the limit) instead of raising; JSON text over the limit keeps its own marker."""
    dumps = payload_dumps(40)
    for text in ('{"v":"' + "x" * 100, '{"v":"' + "x" * 100 + '"}'):
        assert dumps(jsonsafe.RawJson(text)) == dumps(jsonsafe.loads(text))
        assert b"$agentcap.truncated" in dumps(jsonsafe.RawJson(text))


def test_deferred_rows_are_built_only_when_read() -> None:
    """DeferredRows gives its runs and length without building a row, builds each row once when
    read, and equals the list of those rows."""
    built: list[tuple[Any, ...]] = []

    def make(item: tuple[Any, ...]) -> tuple[Any, ...]:
        built.append(item)
        return ("row", *item)

    rows = DeferredRows([("r1", 1), ("r2", 2), ("r1", 3)], make, 0)
    assert len(rows) == 3 and rows
    assert span_row_runs(rows) == {"r1", "r2"}
    assert rows.run_counts() == {"r1": 2, "r2": 1}
    assert built == []
    assert rows == [("row", "r1", 1), ("row", "r2", 2), ("row", "r1", 3)]
    assert list(rows) == rows[:]
    assert len(built) == 3
    assert rows != [("row", "r1", 1)]
    assert not DeferredRows([], make, 0)
