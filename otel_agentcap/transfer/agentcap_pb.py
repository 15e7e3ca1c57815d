"""``agentcap-pb``: a run as a length-delimited stream of ``agentcap.eventlog.v1.Batch`` messages
(``proto/agentcap/eventlog/v1/eventlog.proto``): each message preceded by its size as a varint.
The first batch holds the header (which counts the batches, so that a stream cut short between
two of them reads as cut short), the run, its agents and span envelopes; events follow in batches
of :data:`EVENTS_PER_BATCH`, then the conflicts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from otel_agentcap._proto import eventlog_pb2 as pb
from otel_agentcap.transfer.snapshot import (
    AgentRow,
    ConflictRow,
    EventRow,
    RunRow,
    RunSnapshot,
    SpanRow,
)
from otel_agentcap.version import __version__

FORMAT: Final = "agentcap-pb"
SCHEMA: Final = "agentcap.eventlog.v1"
EVENTS_PER_BATCH: Final = 1000


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


def batches(snapshot: RunSnapshot) -> Iterator[Any]:
    run = snapshot.run
    events = snapshot.events
    count = 1 + -(-len(events) // EVENTS_PER_BATCH) + (1 if snapshot.conflicts else 0)
    head = pb.Batch(
        header=pb.Header(
            format=FORMAT,
            schema=SCHEMA,
            producer=f"otel-agentcap {__version__}",
            batches=count,
        )
    )
    head.runs.append(
        _optional(
            pb.Run(run_id=run.run_id, attributes_json=run.attributes_json),
            started_at_unix_nano=None if run.started_at_us is None else run.started_at_us * 1000,
            trace_id=run.trace_id,
            root_span_id=run.root_span_id,
        )
    )
    for agent in snapshot.agents:
        head.agents.append(
            _optional(
                pb.Agent(run_id=agent.run_id, agent_id=agent.agent_id),
                name=agent.name,
                parent_agent_id=agent.parent_agent_id,
                spawned_at_event_id=agent.spawned_at_event_id,
            )
        )
    for span in snapshot.spans:
        head.spans.append(
            _optional(
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
        )
    yield head
    for start in range(0, len(events), EVENTS_PER_BATCH):
        yield pb.Batch(events=[_event(row) for row in events[start : start + EVENTS_PER_BATCH]])
    if snapshot.conflicts:
        conflicts = pb.Batch()
        for conflict in snapshot.conflicts:
            conflicts.conflicts.append(
                _optional(
                    pb.Conflict(
                        reason=conflict.reason,
                        detected_at_unix_nano=conflict.detected_at_us * 1000,
                        row_digest=conflict.row_digest,
                        event=_event(conflict.event),
                    ),
                    existing_event_id=conflict.existing_event_id,
                )
            )
        yield conflicts


def dumps(snapshot: RunSnapshot) -> bytes:
    parts = []
    for batch in batches(snapshot):
        data = batch.SerializeToString(deterministic=True)
        parts.append(_varint(len(data)))
        parts.append(data)
    return b"".join(parts)


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


def loads(data: bytes) -> list[RunSnapshot]:
    """The runs of an agentcap-pb stream (normally one)."""
    runs: dict[str, RunRow] = {}
    agents: dict[str, list[AgentRow]] = {}
    spans: dict[str, list[SpanRow]] = {}
    events: dict[str, list[EventRow]] = {}
    conflicts: dict[str, list[ConflictRow]] = {}
    # Messages a header announced and how many of them came (0 of 0: the header did not say).
    announced = seen = 0
    for index, batch in enumerate(read_batches(data)):
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
        for run in batch.runs:
            started = _opt(run, "started_at_unix_nano")
            runs[run.run_id] = RunRow(
                run.run_id,
                None if started is None else started // 1000,
                run.attributes_json or "{}",
                _opt(run, "trace_id"),
                _opt(run, "root_span_id"),
            )
        for agent in batch.agents:
            agents.setdefault(agent.run_id, []).append(
                AgentRow(
                    agent.run_id,
                    agent.agent_id,
                    _opt(agent, "name"),
                    _opt(agent, "parent_agent_id"),
                    _opt(agent, "spawned_at_event_id"),
                )
            )
        for span in batch.spans:
            spans.setdefault(span.run_id, []).append(
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
            )
        for event in batch.events:
            events.setdefault(event.run_id, []).append(_event_row(event))
        for conflict in batch.conflicts:
            row = _event_row(conflict.event)
            conflicts.setdefault(row.run_id, []).append(
                ConflictRow(
                    conflict.reason,
                    _opt(conflict, "existing_event_id"),
                    conflict.detected_at_unix_nano // 1000,
                    conflict.row_digest,
                    row,
                )
            )
    _check_count(announced, seen)
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
