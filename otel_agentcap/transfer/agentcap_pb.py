"""``agentcap-pb``: a run as a length-delimited stream of ``agentcap.eventlog.v1.Batch`` messages
(``proto/agentcap/eventlog/v1/eventlog.proto``): each message preceded by its size as a varint.
The first batch holds the header (which counts the batches, so that a stream cut short between
two of them reads as cut short), the run, and its first :data:`ROWS_PER_BATCH` agents and span
envelopes; the other agents, then the other span envelopes follow in batches of as many, then the
events in batches of :data:`EVENTS_PER_BATCH`, then the conflict rows in batches of
:data:`ROWS_PER_BATCH`. (Earlier versions put every agent and span envelope in the first batch
and the conflict rows in one batch: the same bytes for a run with at most 1,000 of each; readers,
these and earlier ones, take rows of any kind from any batch.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any, BinaryIO, Final, TypeVar

from otel_agentcap._proto import eventlog_pb2 as pb
from otel_agentcap.transfer.snapshot import (
    AgentRow,
    ConflictRow,
    EventRow,
    RowCounts,
    RunReader,
    RunRow,
    RunSnapshot,
    SpanRow,
)
from otel_agentcap.version import __version__

FORMAT: Final = "agentcap-pb"
SCHEMA: Final = "agentcap.eventlog.v1"
EVENTS_PER_BATCH: Final = 1000
#: Agents, span envelopes and conflict rows a batch holds at most.
ROWS_PER_BATCH: Final = 1000
_Row = TypeVar("_Row")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _event(row: EventRow) -> Any:
    event = pb.Event(
        event_id=row.event_id,
        run_id=row.run_id,
        agent_id=row.agent_id,
        logical_seq=row.logical_seq,
        wall_time_unix_nano=row.wall_time_us * 1000,
        event_type=row.event_type,
        causal_parent_ids=list(row.causal_parent_ids),
        idempotency_key=row.idempotency_key,
    )
    if row.trace_id is not None:
        event.trace_id = row.trace_id
    if row.span_id is not None:
        event.span_id = row.span_id
    if row.payload_json is not None:
        event.payload_json = row.payload_json
    return event


def _optional(message: Any, **fields: Any) -> Any:
    for name, value in fields.items():
        if value is not None:
            setattr(message, name, value)
    return message


def _run(run: RunRow) -> Any:
    return _optional(
        pb.Run(run_id=run.run_id, attributes_json=run.attributes_json),
        started_at_unix_nano=None if run.started_at_us is None else run.started_at_us * 1000,
        trace_id=run.trace_id,
        root_span_id=run.root_span_id,
    )


def _agent(agent: AgentRow) -> Any:
    return _optional(
        pb.Agent(run_id=agent.run_id, agent_id=agent.agent_id),
        name=agent.name,
        parent_agent_id=agent.parent_agent_id,
        spawned_at_event_id=agent.spawned_at_event_id,
    )


def _span(span: SpanRow) -> Any:
    return _optional(
        pb.Span(
            run_id=span.run_id,
            trace_id=span.trace_id,
            span_id=span.span_id,
            name=span.name,
            kind=span.kind,
            start_time_unix_nano=span.start_us * 1000,
            end_time_unix_nano=span.end_us * 1000,
            status_code=span.status_code,
        ),
        parent_span_id=span.parent_span_id,
        status_message=span.status_message,
        service_name=span.service_name,
        scope_name=span.scope_name,
    )


def _conflict(conflict: ConflictRow) -> Any:
    return _optional(
        pb.Conflict(
            reason=conflict.reason,
            detected_at_unix_nano=conflict.detected_at_us * 1000,
            row_digest=conflict.row_digest,
            event=_event(conflict.event),
        ),
        existing_event_id=conflict.existing_event_id,
    )


def _chunks(rows: Iterable[_Row], size: int) -> Iterator[list[_Row]]:
    iterator = iter(rows)
    while chunk := list(islice(iterator, size)):
        yield chunk


def _batches_after_the_first(rows: int, size: int) -> int:
    return -(-max(0, rows - size) // size)


def batch_count(counts: RowCounts) -> int:
    """How many messages :func:`layout` writes for a run with ``counts`` rows."""
    return (
        1
        + _batches_after_the_first(counts.agents, ROWS_PER_BATCH)
        + _batches_after_the_first(counts.spans, ROWS_PER_BATCH)
        + -(-counts.events // EVENTS_PER_BATCH)
        + -(-counts.conflicts // ROWS_PER_BATCH)
    )


def layout(
    run: RunRow,
    counts: RowCounts,
    agents: Iterable[AgentRow],
    spans: Iterable[SpanRow],
    events: Iterable[EventRow],
    conflicts: Iterable[ConflictRow],
) -> Iterator[Any]:
    """The messages of one run, built as they are yielded: each iterable is read once, in the
    order agents, spans, events, conflicts, one batch at a time (of :data:`ROWS_PER_BATCH` rows,
    :data:`EVENTS_PER_BATCH` events). ``counts`` gives the header's count of messages; an iterable
    that gives another number of rows is a ``RuntimeError``."""
    announced = batch_count(counts)
    head = pb.Batch(
        header=pb.Header(
            format=FORMAT,
            schema=SCHEMA,
            producer=f"otel-agentcap {__version__}",
            batches=announced,
        )
    )
    head.runs.append(_run(run))
    agent_chunks = _chunks(agents, ROWS_PER_BATCH)
    span_chunks = _chunks(spans, ROWS_PER_BATCH)
    head.agents.extend(_agent(a) for a in next(agent_chunks, []))
    head.spans.extend(_span(s) for s in next(span_chunks, []))
    written = 1
    seen = RowCounts(len(head.agents), len(head.spans), 0, 0)
    yield head
    rest: tuple[tuple[str, Iterator[list[Any]], Callable[[Any], Any]], ...] = (
        ("agents", agent_chunks, _agent),
        ("spans", span_chunks, _span),
        ("events", _chunks(events, EVENTS_PER_BATCH), _event),
        ("conflicts", _chunks(conflicts, ROWS_PER_BATCH), _conflict),
    )
    for kind, chunks, make in rest:
        for chunk in chunks:
            batch = pb.Batch()
            getattr(batch, kind).extend(make(row) for row in chunk)
            seen = replace(seen, **{kind: getattr(seen, kind) + len(chunk)})
            written += 1
            yield batch
    if seen != counts or written != announced:
        raise RuntimeError(f"the run's rows changed while it was exported: {seen} for {counts}")


def batches(snapshot: RunSnapshot) -> Iterator[Any]:
    counts = RowCounts(
        len(snapshot.agents), len(snapshot.spans), len(snapshot.events), len(snapshot.conflicts)
    )
    return layout(
        snapshot.run,
        counts,
        snapshot.agents,
        snapshot.spans,
        snapshot.events,
        snapshot.conflicts,
    )


def _framed(batch: Any) -> bytes:
    data = batch.SerializeToString(deterministic=True)
    return _varint(len(data)) + bytes(data)


def dumps(snapshot: RunSnapshot) -> bytes:
    return b"".join(_framed(batch) for batch in batches(snapshot))


def write_run(reader: RunReader, out: BinaryIO) -> int:
    """Write the run of ``reader`` to ``out`` batch by batch, as :func:`dumps` would give it:
    memory holds one batch (and the rows a cursor fetched) at a time. Returns the bytes written."""
    size = 0
    for batch in layout(
        reader.run,
        reader.counts,
        reader.agents(),
        reader.spans(),
        reader.events(),
        reader.conflicts(),
    ):
        data = _framed(batch)
        out.write(data)
        size += len(data)
    return size


# --------------------------------------------------------------------------- reading


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it; ``ValueError`` when cut short or
    over 64 bits."""
    value = shift = 0
    while True:
        if position >= len(data):
            raise ValueError("truncated agentcap-pb stream (in a length prefix)")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position
        if shift > 63:
            raise ValueError("invalid length prefix in agentcap-pb stream")


def read_batches(data: bytes) -> Iterator[Any]:
    """The ``Batch`` messages of a stream; raises ``ValueError`` on a truncated or undecodable
    one."""
    position = 0
    while position < len(data):
        size, position = _read_varint(data, position)
        end = position + size
        if end > len(data):
            raise ValueError("truncated agentcap-pb stream (in a message)")
        batch = pb.Batch()
        try:
            batch.ParseFromString(data[position:end])
        except Exception as exc:  # google.protobuf.message.DecodeError
            raise ValueError(f"undecodable agentcap-pb message: {exc}") from None
        position = end
        yield batch


def _read_exactly(source: BinaryIO, size: int, where: str) -> bytes:
    """``size`` bytes of ``source``, read in pieces (a corrupt size allocates nothing)."""
    parts = []
    left = size
    while left:
        part = source.read(min(left, 1 << 20))
        if not part:
            raise ValueError(f"truncated agentcap-pb stream ({where})")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_stream(source: BinaryIO) -> Iterator[Any]:
    """The ``Batch`` messages of the stream in the file ``source``, read one at a time (memory
    holds one message); raises ``ValueError`` as :func:`read_batches` does."""
    while True:
        first = source.read(1)
        if not first:
            return
        prefix = bytearray(first)
        while prefix[-1] & 0x80:
            if len(prefix) > 9:
                raise ValueError("invalid length prefix in agentcap-pb stream")
            prefix += _read_exactly(source, 1, "in a length prefix")
        size, _ = _read_varint(bytes(prefix), 0)
        data = _read_exactly(source, size, "in a message")
        batch = pb.Batch()
        try:
            batch.ParseFromString(data)
        except Exception as exc:  # google.protobuf.message.DecodeError
            raise ValueError(f"undecodable agentcap-pb message: {exc}") from None
        yield batch


def is_agentcap_pb(data: bytes) -> bool:
    """Whether ``data`` starts with an agentcap-pb header: the header alone is read, so a stream
    cut short after it is still recognised (and reported as cut short when read)."""
    try:
        _, position = _read_varint(data, 0)  # the first message's length
        if data[position : position + 1] != b"\x0a":  # Batch.header: field 1, length-delimited
            return False
        size, position = _read_varint(data, position + 1)
        if position + size > len(data):
            return False
        header = pb.Header()
        header.ParseFromString(data[position : position + size])
    except Exception:  # ValueError, google.protobuf.message.DecodeError
        return False
    return bool(header.format == FORMAT)


def _check_count(announced: int, seen: int) -> None:
    if seen < announced:
        raise ValueError(
            f"truncated agentcap-pb stream (after {seen} of the {announced} messages its header "
            "announced)"
        )


def _event_row(event: Any) -> EventRow:
    return EventRow(
        event.event_id,
        event.run_id,
        event.agent_id,
        event.logical_seq,
        event.wall_time_unix_nano // 1000,
        event.event_type,
        tuple(event.causal_parent_ids),
        event.idempotency_key,
        event.trace_id if event.HasField("trace_id") else None,
        event.span_id if event.HasField("span_id") else None,
        event.payload_json if event.HasField("payload_json") else None,
    )


def _opt(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


@dataclass(frozen=True, slots=True)
class BatchRows:
    """The rows of one ``Batch`` message, in the form the log holds them."""

    runs: list[RunRow]
    agents: list[AgentRow]
    spans: list[SpanRow]
    events: list[EventRow]
    conflicts: list[ConflictRow]


def batch_rows(batch: Any) -> BatchRows:
    return BatchRows(
        [
            RunRow(
                run.run_id,
                None
                if not run.HasField("started_at_unix_nano")
                else run.started_at_unix_nano // 1000,
                run.attributes_json or "{}",
                _opt(run, "trace_id"),
                _opt(run, "root_span_id"),
            )
            for run in batch.runs
        ],
        [
            AgentRow(
                agent.run_id,
                agent.agent_id,
                _opt(agent, "name"),
                _opt(agent, "parent_agent_id"),
                _opt(agent, "spawned_at_event_id"),
            )
            for agent in batch.agents
        ],
        [
            SpanRow(
                span.run_id,
                span.trace_id,
                span.span_id,
                _opt(span, "parent_span_id"),
                span.name,
                span.kind,
                span.start_time_unix_nano // 1000,
                span.end_time_unix_nano // 1000,
                span.status_code,
                _opt(span, "status_message"),
                _opt(span, "service_name"),
                _opt(span, "scope_name"),
            )
            for span in batch.spans
        ],
        [_event_row(event) for event in batch.events],
        [
            ConflictRow(
                conflict.reason,
                _opt(conflict, "existing_event_id"),
                conflict.detected_at_unix_nano // 1000,
                conflict.row_digest,
                _event_row(conflict.event),
            )
            for conflict in batch.conflicts
        ],
    )


def checked(batches: Iterable[Any]) -> Iterator[Any]:
    """``batches`` (the messages of a stream), checked as they come: the first is a header of
    this format, every header names this schema, and each header's count of messages came
    (``ValueError`` otherwise, when the check fails)."""
    # Messages a header announced and how many of them came (0 of 0: the header did not say).
    announced = seen = 0
    for index, batch in enumerate(batches):
        if index == 0 and (not batch.HasField("header") or batch.header.format != FORMAT):
            raise ValueError("not an agentcap-pb stream (no header)")
        if batch.HasField("header"):
            if batch.header.schema != SCHEMA:
                raise ValueError(
                    f"unsupported schema {batch.header.schema!r} (this reads {SCHEMA})"
                )
            _check_count(announced, seen)
            announced, seen = batch.header.batches, 0
        seen += 1
        yield batch
    _check_count(announced, seen)


def loads(data: bytes) -> list[RunSnapshot]:
    """The runs of an agentcap-pb stream (normally one)."""
    runs: dict[str, RunRow] = {}
    agents: dict[str, list[AgentRow]] = {}
    spans: dict[str, list[SpanRow]] = {}
    events: dict[str, list[EventRow]] = {}
    conflicts: dict[str, list[ConflictRow]] = {}
    for batch in checked(read_batches(data)):
        rows = batch_rows(batch)
        for run in rows.runs:
            runs[run.run_id] = run
        for agent in rows.agents:
            agents.setdefault(agent.run_id, []).append(agent)
        for span in rows.spans:
            spans.setdefault(span.run_id, []).append(span)
        for event in rows.events:
            events.setdefault(event.run_id, []).append(event)
        for conflict in rows.conflicts:
            conflicts.setdefault(conflict.event.run_id, []).append(conflict)
    # Every row a log holds of a run belongs to its run row, which an export writes first: rows
    # of a run with no record would make up a run (its start guessed from the events) or be lost.
    named: dict[str, Any] = {
        "agents": agents,
        "spans": spans,
        "events": events,
        "conflicts": conflicts,
    }
    for what, rows in named.items():
        orphans = sorted(rows.keys() - runs.keys())
        if orphans:
            raise ValueError(
                f"the agentcap-pb stream holds {what} of run {orphans[0]!r} but no record of "
                "that run"
            )
    return [
        RunSnapshot(
            run,
            tuple(agents.get(run_id, ())),
            tuple(spans.get(run_id, ())),
            tuple(events.get(run_id, ())),
            tuple(conflicts.get(run_id, ())),
        )
        for run_id, run in runs.items()
    ]
