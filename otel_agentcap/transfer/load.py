"""``otel-agentcap import``: load a file into any event log, deduplicated.

Accepted: ``agentcap-pb`` (every row, conflicts included), OTLP/JSON (an ``ExportTraceServiceRequest``
or ``TracesData``, such as ``export --format otlp-json`` writes) and OTLP protobuf (a serialized
``ExportTraceServiceRequest``; needs ``opentelemetry-proto``). Rows go through the same writer as
the exporter, so what is stored already is counted as a duplicate, a different event on a stored
id goes to ``agentcap.conflicts``, and nothing stored is ever changed.
"""

from __future__ import annotations

import io
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, Final, TypeVar

import psycopg

from otel_agentcap import jsonsafe
from otel_agentcap.exporters.postgres.connection import first_line
from otel_agentcap.exporters.postgres.database import Database, instrumentation_suppressed
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    DataRejected,
    InvalidPayload,
)
from otel_agentcap.exporters.postgres.exporter import log_rejected_spans
from otel_agentcap.exporters.postgres.partitions import ensure_partitions
from otel_agentcap.exporters.postgres.rows import DEFAULT_MAX_PAYLOAD_CHARS, payload_dumps
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult
from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, SpanRecord
from otel_agentcap.pipeline.mapping import batch_from_spans
from otel_agentcap.transfer import agentcap_pb
from otel_agentcap.transfer.otlp_json import spans_from_json
from otel_agentcap.transfer.snapshot import (
    AgentRow,
    ConflictRow,
    EventRow,
    RunRow,
    RunSnapshot,
    SpanRow,
)
from otel_agentcap.transfer.traces import hex_id
from otel_agentcap.validation import uuid_text

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_Row = TypeVar("_Row")
_log = logging.getLogger(__name__)
EVENTS_PER_WRITE: Final = 5000
_UTF8_BOM: Final = b"\xef\xbb\xbf"


@dataclass
class ImportResult:
    format: str
    runs: list[str] = field(default_factory=list)
    events_inserted: int = 0
    duplicates: int = 0
    conflicts: int = 0
    """Events of the file that collided with different stored events (kept in conflicts)."""
    conflicts_imported: int = 0
    """Conflict rows of an agentcap-pb file added to agentcap.conflicts (repeats not counted)."""
    rejected: int = 0
    """Events, agent and run records, and spans of the file left out: they break a validation
    rule or cannot be read as event records (the reasons are logged)."""
    record_conflicts: int = 0
    """Agent or run records that differ from the stored rows (kept in record_conflicts)."""
    expired: int = 0
    """Events of runs the log no longer keeps (started before its retention watermark)."""
    unparsed_attributes: int = 0
    """Runs whose attributes in the file are not a JSON object (not JSON, or a list, a string,
    a number): stored as ``{"$agentcap.unparsed": text}``, their exact text, not dropped."""
    unparsed_payloads: int = 0
    """Payloads of the file (events, and conflict rows of agentcap-pb) that are not JSON, stored
    as ``{"$agentcap.unparsed": text}`` markers, as the OTLP ingest stores them."""

    def add(self, result: WriteResult) -> None:
        self.events_inserted += result.inserted
        self.duplicates += result.duplicates
        self.conflicts += result.conflicts
        self.rejected += result.rejected + result.rejected_records
        self.record_conflicts += result.record_conflicts
        self.expired += result.expired


def _time(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except RecursionError:
        raise DataRejected("a payload is JSON nested too deeply") from None
    except ValueError:
        return False
    return True


def _parsed(text: str) -> Any:
    """``text`` (a payload of the file) parsed and made safe to store: text that is not JSON as
    its ``$agentcap.unparsed`` marker; nested too deeply, ``DataRejected`` (an error to report,
    not a marker in place of a value the file gave)."""
    try:
        return jsonsafe.loads(text, too_deep="raise")
    except RecursionError:
        raise DataRejected("a payload is JSON nested too deeply") from None


def _unparsed_count(texts: Iterable[str | None]) -> int:
    return sum(1 for text in texts if text is not None and not _is_json(text))


def _reparsed(batch: Batch) -> Batch:
    """``batch`` with every payload parsed and made safe (see :func:`_parsed`), for a batch the
    log refused as it was (a payload that is not the JSON it claims)."""
    return batch._replace(
        events=tuple(
            e._replace(payload=_parsed(e.payload)) if isinstance(e.payload, jsonsafe.RawJson) else e
            for e in batch.events
        )
    )


def _event(row: EventRow) -> Event:
    return Event(
        event_id=row.event_id,
        run_id=row.run_id,
        agent_id=row.agent_id,
        seq=row.logical_seq,
        event_type=row.event_type,
        idempotency_key=row.idempotency_key,
        wall_time=_time(row.wall_time_us),
        causal_parent_ids=row.causal_parent_ids,
        payload=(
            None
            if row.payload_json is None
            else jsonsafe.raw_or_loads(row.payload_json, too_deep="raise")
        ),
        trace_id=row.trace_id,
        span_id=row.span_id,
    )


#: OpenTelemetry's SpanKind and StatusCode values, as the log stores them.
_SPAN_KINDS: Final = range(5)
_STATUS_CODES: Final = range(3)


def _span_reason(span: SpanRow) -> str | None:
    """Why ``span`` cannot be a span of a trace (what the otlp-json and jaeger-json exports
    draw), or None."""
    if not hex_id(span.trace_id, 32):
        return f"trace id {span.trace_id[:40]!r} is not 32 lower-case hex digits"
    if not hex_id(span.span_id, 16):
        return f"span id {span.span_id[:40]!r} is not 16 lower-case hex digits"
    if span.parent_span_id is not None and not hex_id(span.parent_span_id, 16):
        return f"parent span id {span.parent_span_id[:40]!r} is not 16 lower-case hex digits"
    if span.kind not in _SPAN_KINDS:
        return f"span kind {span.kind} is not an OpenTelemetry SpanKind (0 to 4)"
    if span.status_code not in _STATUS_CODES:
        return f"status code {span.status_code} is not an OpenTelemetry StatusCode (0 to 2)"
    return None


def _log_left_out(run_id: str, what: str, count: int, reasons: Iterable[str]) -> None:
    if count:
        _log.warning(
            "agentcap: %d %s(s) of run %r broke a validation rule and were left out, e.g.: %s",
            count,
            what,
            run_id,
            "; ".join(sorted(set(reasons))[:3]),
        )


def _without(
    run_id: str, rows: tuple[_Row, ...], what: str, reason_of: Callable[[_Row], str | None]
) -> tuple[tuple[_Row, ...], int]:
    """``rows`` (of run ``run_id``) without those ``reason_of`` finds a reason to leave out
    (logged once, naming up to three reasons), and how many those were."""
    reasons = [(row, reason_of(row)) for row in rows]
    bad = [reason for _, reason in reasons if reason is not None]
    _log_left_out(run_id, what, len(bad), bad)
    return tuple(row for row, reason in reasons if reason is None), len(bad)


def valid_spans(snapshot: RunSnapshot) -> tuple[RunSnapshot, int]:
    """``snapshot`` without the span envelopes no trace can hold, and how many those were: the
    writer takes envelopes as they are, and the trace exports draw them."""
    spans, left_out = _without(snapshot.run.run_id, snapshot.spans, "span envelope", _span_reason)
    return (replace(snapshot, spans=spans) if left_out else snapshot), left_out


#: The reasons agentcap.conflicts admits (its CHECK constraint).
_CONFLICT_REASONS: Final = frozenset(
    {
        "event_id_content",
        "run_agent_seq",
        "run_agent_key",
        "invalid_event_type",
        "model_call_response_id",
        "model_call_request_id",
    }
)


def _conflict_reason(conflict: ConflictRow) -> str | None:
    """Why agentcap.conflicts cannot hold ``conflict``, or None."""
    if conflict.reason not in _CONFLICT_REASONS:
        return f"conflict reason {conflict.reason[:40]!r} is not one the log knows"
    event = conflict.event
    for what, value in (
        ("event id", event.event_id),
        ("existing event id", conflict.existing_event_id),
        *(("causal parent id", parent) for parent in event.causal_parent_ids),
    ):
        if value is not None and not uuid_text(value):
            return f"{what} {value[:40]!r} of a conflict row is not a UUID"
    return None


def valid_conflicts(snapshot: RunSnapshot) -> tuple[RunSnapshot, int]:
    """``snapshot`` without the conflict rows the log cannot hold, and how many those were: they
    would fail the write of the conflicts after the run's rows were stored."""
    conflicts, left_out = _without(
        snapshot.run.run_id, snapshot.conflicts, "conflict row", _conflict_reason
    )
    return (replace(snapshot, conflicts=conflicts) if left_out else snapshot), left_out


def wrapped_attributes(text: str) -> bool:
    """Whether :func:`run_attributes` keeps ``text`` in a marker: text that is not JSON, or JSON
    that is not an object."""
    try:
        return not isinstance(json.loads(text), dict)
    except RecursionError:
        return False  # nested too deeply: an error, not a marker
    except ValueError:
        return True  # not JSON: a marker of jsonsafe.loads


def run_attributes(text: str) -> jsonsafe.EncodedObject:
    """The run attributes a file gives as ``text``, as the log stored them (encoded already).
    Nested too deeply is an error, not a marker. Text that is not JSON, or JSON that is not an
    object (the log only holds objects), is kept whole as ``{"$agentcap.unparsed": text}``."""
    attributes = jsonsafe.loads(text, too_deep="raise")
    if not isinstance(attributes, dict):
        attributes = {"$agentcap.unparsed": text}
    return jsonsafe.EncodedObject(attributes)


def snapshot_batches(snapshot: RunSnapshot) -> list[Batch]:
    """The batches that store ``snapshot`` (its conflicts aside): the run, agents and spans with
    the first events, then the other events in chunks."""
    run = snapshot.run
    attributes = run_attributes(run.attributes_json)
    events = [_event(row) for row in snapshot.events]
    started = (
        _time(run.started_at_us)
        if run.started_at_us is not None
        else min((e.wall_time for e in events), default=None)
    )
    head = Batch(
        events=tuple(events[:EVENTS_PER_WRITE]),
        agents=tuple(_agent_record(a) for a in snapshot.agents),
        runs=(
            RunRecord(
                run.run_id,
                started,
                attributes,
                run.trace_id,
                run.root_span_id,
                start_recorded=run.started_at_us is not None,
            ),
        ),
        spans=tuple(_span_record(s) for s in snapshot.spans),
    )
    rest = [
        Batch(events=tuple(events[start : start + EVENTS_PER_WRITE]))
        for start in range(EVENTS_PER_WRITE, len(events), EVENTS_PER_WRITE)
    ]
    return [head, *rest]


def _readable_batches(snapshot: RunSnapshot) -> list[Batch]:
    try:
        return snapshot_batches(snapshot)
    except RecursionError:
        raise ValueError(
            f"run {snapshot.run.run_id!r}: its attributes or a payload are JSON nested too deeply"
        ) from None


# A conflict row lives in the partition of its run's start, which the run's row (stored by the
# writer with the snapshot's first batch) holds; a run the log refused (pruned) takes none.
_INSERT_CONFLICT: Final = """
INSERT INTO agentcap.conflicts (reason, existing_event_id, row_digest, detected_at, event_id,
    run_id, agent_id, logical_seq, wall_time, event_type, causal_parent_ids, idempotency_key,
    trace_id, span_id, payload, run_started_at)
SELECT %s, %s, %s, %s, %s, r.run_id, %s, %s, %s, %s, %s::uuid[], %s, %s, %s, %s::jsonb,
       r.started_at
FROM agentcap.runs r WHERE r.run_id = %s
ON CONFLICT (run_id, run_started_at, reason, existing_event_id, row_digest) DO NOTHING
"""


def _import_conflicts(database: Database, snapshot: RunSnapshot) -> tuple[int, int]:
    """Add the conflict rows of ``snapshot``: how many were added, and how many of their
    payloads were not JSON (stored as markers, see :func:`_parsed`)."""
    if not snapshot.conflicts:
        return 0, 0
    added = 0
    dumps = payload_dumps(DEFAULT_MAX_PAYLOAD_CHARS)
    payloads = [
        None if c.event.payload_json is None else dumps(_parsed(c.event.payload_json)).decode()
        for c in snapshot.conflicts
    ]
    unparsed = _unparsed_count(c.event.payload_json for c in snapshot.conflicts)
    with database.pool.connection() as conn:
        row = conn.execute(
            "SELECT started_at FROM agentcap.runs WHERE run_id = %s", (snapshot.run.run_id,)
        ).fetchone()
        conn.rollback()
        if row is not None:
            ensure_partitions(conn, [row[0]])
    with database.pool.connection() as conn, conn.transaction():
        for conflict, payload in zip(snapshot.conflicts, payloads, strict=True):
            e = conflict.event
            cursor = conn.execute(
                _INSERT_CONFLICT,
                (
                    conflict.reason,
                    conflict.existing_event_id,
                    conflict.row_digest,
                    _time(conflict.detected_at_us),
                    e.event_id,
                    e.agent_id,
                    e.logical_seq,
                    _time(e.wall_time_us),
                    e.event_type,
                    list(e.causal_parent_ids),
                    e.idempotency_key,
                    e.trace_id,
                    e.span_id,
                    payload,
                    e.run_id,
                ),
            )
            added += cursor.rowcount
    return added, unparsed


class ImportIncomplete(AgentCapStorageError):
    """A write failed after part of the file was stored, which stays stored (the log is
    append-only): the message says what it is, ``result`` counts it."""

    def __init__(self, message: str, result: ImportResult) -> None:
        super().__init__(message)
        self.result = result


def _import_snapshots(
    database: Database,
    writer: EventWriter,
    planned: list[tuple[RunSnapshot, list[Batch]]],
    result: ImportResult,
) -> None:
    """Write each run's batches, then its conflicts; a failure after the first write raises
    :class:`ImportIncomplete` naming what was stored (each batch is all or nothing)."""
    for number, (snapshot, batches) in enumerate(planned):
        run_id = snapshot.run.run_id
        result.runs.append(run_id)
        written = events = unparsed = 0
        try:
            for batch in batches:
                try:
                    result.add(writer.write(batch))
                except InvalidPayload:
                    # A payload that is not the JSON it claims: write the batch again with every
                    # payload parsed, as the exporter and the OTLP ingest do.
                    result.add(writer.write(_reparsed(batch)))
                    unparsed += _unparsed_count(
                        e.payload for e in batch.events if isinstance(e.payload, jsonsafe.RawJson)
                    )
                written += 1
                events += len(batch.events)
            added, conflicts_unparsed = _import_conflicts(database, snapshot)
            result.conflicts_imported += added
            unparsed += conflicts_unparsed
        except (AgentCapStorageError, psycopg.Error) as exc:
            if number == 0 and written == 0:
                raise  # nothing stored
            if written == 0:
                part = f"nothing of run {run_id!r}"
            elif written < len(batches):
                part = (
                    f"of run {run_id!r} its run, agent and span records and {events} of its "
                    f"{len(snapshot.events)} events"
                )
            else:
                part = f"run {run_id!r} but for its {len(snapshot.conflicts)} conflict rows"
            stored = [f"run {s.run.run_id!r} in full" for s, _ in planned[:number]]
            rest = [s.run.run_id for s, _ in planned[number + 1 :]]
            _count_unparsed(result, run_id, unparsed)
            raise ImportIncomplete(
                f"import stopped part-way ({first_line(exc)}); stored: "
                + ", ".join([*stored, part])
                + (
                    f"; not stored: the runs after it ({', '.join(map(repr, rest))})"
                    if rest
                    else ""
                ),
                result,
            ) from exc
        _count_unparsed(result, run_id, unparsed)


# --------------------------------------------------------------------------- agentcap-pb, streamed

#: Agent records and span envelopes a write holds at most (beside its events).
RECORDS_PER_WRITE: Final = 5000


@dataclass
class _RunSurvey:
    """What the first reading of a streamed file learnt of one run."""

    run: RunRow
    events: int = 0
    conflicts: int = 0
    first_wall_us: int | None = None
    spans_left_out: int = 0
    span_reasons: set[str] = field(default_factory=set)
    conflicts_left_out: int = 0
    conflict_reasons: set[str] = field(default_factory=set)


def _keep_first(reasons: set[str], reason: str) -> None:
    """Add ``reason``, keeping the few first in order that the warning names, not every one."""
    reasons.add(reason)
    if len(reasons) > 64:
        kept = sorted(reasons)[:3]
        reasons.clear()
        reasons.update(kept)


def _survey(source: BinaryIO) -> list[_RunSurvey] | None:
    """Read the agentcap-pb stream of ``source`` once, a message at a time, checking all that
    :func:`agentcap_pb.loads` and the conversion to batches check (``ValueError``, as they raise
    it, when one fails): the runs it holds, in order. None when the file is not in the order an
    export writes (each run's record, then its rows, each run once), which the whole-file reading
    takes instead."""
    runs: list[_RunSurvey] = []
    seen: set[str] = set()
    in_order = True
    too_deep: str | None = None  # raised after the whole file was read, as loads() would
    for batch in agentcap_pb.checked(agentcap_pb.read_stream(source)):
        rows = agentcap_pb.batch_rows(batch)
        if len(rows.runs) > 1 or any(r.run_id in seen for r in rows.runs):
            in_order = False
        for run in rows.runs:
            seen.add(run.run_id)
            runs.append(_RunSurvey(run))
        if not in_order:
            continue
        current = runs[-1].run.run_id if runs else None
        run_ids = {
            *(a.run_id for a in rows.agents),
            *(x.run_id for x in rows.spans),
            *(e.run_id for e in rows.events),
            *(c.event.run_id for c in rows.conflicts),
        }
        if run_ids - {current}:
            in_order = False
            continue
        survey = runs[-1]
        if too_deep is None:
            try:
                if rows.runs:
                    run_attributes(survey.run.attributes_json)
                for event in rows.events:
                    _event(event)
            except RecursionError:
                too_deep = survey.run.run_id
        survey.events += len(rows.events)
        for event in rows.events:
            if survey.first_wall_us is None or event.wall_time_us < survey.first_wall_us:
                survey.first_wall_us = event.wall_time_us
        for span in rows.spans:
            reason = _span_reason(span)
            if reason is not None:
                survey.spans_left_out += 1
                _keep_first(survey.span_reasons, reason)
        for conflict in rows.conflicts:
            reason = _conflict_reason(conflict)
            if reason is None:
                survey.conflicts += 1
            else:
                survey.conflicts_left_out += 1
                _keep_first(survey.conflict_reasons, reason)
    if not in_order:
        return None
    if too_deep is not None:
        raise ValueError(
            f"run {too_deep!r}: its attributes or a payload are JSON nested too deeply"
        )
    return runs


def _head(run: RunRow, first_wall_us: int | None) -> Batch:
    started = (
        _time(run.started_at_us)
        if run.started_at_us is not None
        else None
        if first_wall_us is None
        else _time(first_wall_us)
    )
    return Batch(
        runs=(
            RunRecord(
                run.run_id,
                started,
                run_attributes(run.attributes_json),
                run.trace_id,
                run.root_span_id,
                start_recorded=run.started_at_us is not None,
            ),
        )
    )


def _agent_record(a: AgentRow) -> AgentRecord:
    # A parent in the file is a known lineage; a row without one may be a root or an agent whose
    # lineage its log did not know: left unknown.
    return AgentRecord(
        a.run_id,
        a.agent_id,
        a.name,
        a.parent_agent_id,
        a.spawned_at_event_id,
        lineage_known=a.parent_agent_id is not None,
    )


def _span_record(s: SpanRow) -> SpanRecord:
    return SpanRecord(
        s.run_id,
        s.trace_id,
        s.span_id,
        s.parent_span_id,
        s.name,
        s.kind,
        _time(s.start_us),
        _time(s.end_us),
        s.status_code,
        s.status_message,
        s.service_name,
        s.scope_name,
    )


class _RunWriter:
    """Writes one run of a streamed file as its rows come: the run record, agents and span
    envelopes with the first events, then the events in writes of :data:`EVENTS_PER_WRITE` (as
    :func:`snapshot_batches` groups them, while a run has at most :data:`RECORDS_PER_WRITE`
    agents and envelopes), then its conflict rows; it holds one write's rows at a time (and the
    run's conflict rows, written last in one transaction)."""

    def __init__(
        self, database: Database, writer: EventWriter, survey: _RunSurvey, result: ImportResult
    ) -> None:
        self.database = database
        self.writer = writer
        self.survey = survey
        self.result = result
        self.head: Batch | None = _head(survey.run, survey.first_wall_us)
        self.agents: list[AgentRecord] = []
        self.spans: list[SpanRecord] = []
        self.events: list[Event] = []
        self.conflicts: list[ConflictRow] = []
        self.written = self.events_written = self.unparsed = 0
        self.conflicts_started = False

    def add(self, rows: agentcap_pb.BatchRows) -> None:
        if rows.agents or rows.spans:
            if self.events or len(self.agents) + len(self.spans) >= RECORDS_PER_WRITE:
                self._flush()
            self.agents.extend(_agent_record(a) for a in rows.agents)
            self.spans.extend(_span_record(x) for x in rows.spans if _span_reason(x) is None)
        for event in rows.events:
            self.events.append(_event(event))
            if len(self.events) >= EVENTS_PER_WRITE:
                self._flush()
        self.conflicts.extend(c for c in rows.conflicts if _conflict_reason(c) is None)

    def _flush(self) -> None:
        batch = (self.head or Batch())._replace(
            events=tuple(self.events), agents=tuple(self.agents), spans=tuple(self.spans)
        )
        self.head = None
        self.events, self.agents, self.spans = [], [], []
        if not (batch.events or batch.agents or batch.spans or batch.runs):
            return
        try:
            self.result.add(self.writer.write(batch))
        except InvalidPayload:
            # A payload that is not the JSON it claims: write the batch again with every payload
            # parsed, as the exporter and the OTLP ingest do.
            self.result.add(self.writer.write(_reparsed(batch)))
            self.unparsed += _unparsed_count(
                e.payload for e in batch.events if isinstance(e.payload, jsonsafe.RawJson)
            )
        self.written += 1
        self.events_written += len(batch.events)

    def finish(self) -> None:
        self._flush()
        self.conflicts_started = True
        snapshot = RunSnapshot(self.survey.run, (), (), (), tuple(self.conflicts))
        added, conflicts_unparsed = _import_conflicts(self.database, snapshot)
        self.result.conflicts_imported += added
        self.unparsed += conflicts_unparsed

    def stored(self) -> str:
        """What of the run is stored, after a write failed."""
        run_id = self.survey.run.run_id
        if self.conflicts_started:
            return f"run {run_id!r} but for its {self.survey.conflicts} conflict rows"
        if self.written == 0:
            return f"nothing of run {run_id!r}"
        return (
            f"of run {run_id!r} its run, agent and span records and {self.events_written} of its "
            f"{self.survey.events} events"
        )


def import_stream(database: Database, source: BinaryIO) -> ImportResult:
    """Load the agentcap-pb stream of the seekable file ``source`` into the log of ``database``,
    reading it twice, one message at a time: first to check it whole (a file that cannot be read
    stores nothing, as :func:`import_file` says), then to write it, a batch of rows at a time.
    A file not in the order an export writes it is read whole, as :func:`import_file` reads it.
    Raises as :func:`import_file` does."""
    start = source.tell()
    surveys = _survey(source)
    source.seek(start)
    if surveys is None:
        return import_file(database, source.read(), _whole=True)
    result = ImportResult("agentcap-pb")
    for survey in surveys:
        run_id = survey.run.run_id
        _log_left_out(run_id, "span envelope", survey.spans_left_out, survey.span_reasons)
        _log_left_out(run_id, "conflict row", survey.conflicts_left_out, survey.conflict_reasons)
        if wrapped_attributes(survey.run.attributes_json):
            _count_wrapped_attributes(result, run_id)
        result.rejected += survey.spans_left_out + survey.conflicts_left_out
    writer = EventWriter(database.pool)
    try:
        with instrumentation_suppressed():
            database.ensure_schema()
            _write_stream(database, writer, source, surveys, result)
    finally:
        writer.close()
    return result


def _write_stream(
    database: Database,
    writer: EventWriter,
    source: BinaryIO,
    surveys: list[_RunSurvey],
    result: ImportResult,
) -> None:
    number = -1
    current: _RunWriter | None = None
    try:
        for batch in agentcap_pb.read_stream(source):
            rows = agentcap_pb.batch_rows(batch)
            if rows.runs:
                if current is not None:
                    current.finish()
                    _count_unparsed(result, current.survey.run.run_id, current.unparsed)
                number += 1
                current = _RunWriter(database, writer, surveys[number], result)
                result.runs.append(current.survey.run.run_id)
            assert current is not None  # _survey: every row follows its run's record
            current.add(rows)
        if current is not None:
            current.finish()
            _count_unparsed(result, current.survey.run.run_id, current.unparsed)
    except (AgentCapStorageError, psycopg.Error) as exc:
        if current is None or (number == 0 and current.written == 0):
            raise  # nothing stored
        _count_unparsed(result, current.survey.run.run_id, current.unparsed)
        stored = [f"run {s.run.run_id!r} in full" for s in surveys[:number]]
        rest = [s.run.run_id for s in surveys[number + 1 :]]
        raise ImportIncomplete(
            f"import stopped part-way ({first_line(exc)}); stored: "
            + ", ".join([*stored, current.stored()])
            + (f"; not stored: the runs after it ({', '.join(map(repr, rest))})" if rest else ""),
            result,
        ) from exc


def _count_wrapped_attributes(result: ImportResult, run_id: str) -> None:
    result.unparsed_attributes += 1
    _log.warning(
        "agentcap: the attributes of run %r are not a JSON object; stored "
        'as {"$agentcap.unparsed": text}, their exact text',
        run_id,
    )


def _write_otlp(writer: EventWriter, spans: list[Any], batch: Batch, result: ImportResult) -> None:
    """Store the batch of an OTLP file, as ``write_spans`` does; payloads that are not JSON
    (stored as markers) are counted, as for an agentcap-pb file."""
    try:
        result.add(writer.write(batch))
    except InvalidPayload:
        # A payload that is not the JSON it claims: write the batch again with every payload
        # parsed and made safe (text that is not JSON as its marker).
        result.add(writer.write(batch_from_spans(spans)))
        marked = Counter(
            e.run_id
            for e in batch.events
            if isinstance(e.payload, jsonsafe.RawJson) and jsonsafe.gives_marker(e.payload)
        )
        for run_id, count in marked.items():
            _count_unparsed(result, run_id, count)


def _count_unparsed(result: ImportResult, run_id: str, count: int) -> None:
    result.unparsed_payloads += count
    if count:
        _log.warning(
            "agentcap: %d payload(s) of run %r are not JSON; stored as "
            '{"$agentcap.unparsed": text} markers, as the OTLP ingest stores them',
            count,
            run_id,
        )


def detect_format(data: bytes) -> str:
    """``agentcap-pb``, ``otlp-json`` or ``otlp-protobuf``."""
    if data.lstrip()[:1] == b"{":
        return "otlp-json"
    if agentcap_pb.is_agentcap_pb(data):
        return "agentcap-pb"
    return "otlp-protobuf"


def _otlp_json_documents(data: bytes) -> list[Any]:
    """The OTLP/JSON requests in ``data``: one document, or JSON Lines (one request a line, as the
    OpenTelemetry Collector's file exporter writes them)."""
    try:
        return [json.loads(data)]
    except RecursionError:
        raise ValueError("not OTLP/JSON: nested too deeply") from None
    except ValueError as exc:
        whole_error = exc
    lines = [line for line in data.splitlines() if line.strip()]
    try:
        # JSON Lines only if the first line is a document of its own; otherwise the error is the
        # whole file's (a document cut short, say, reported where JSON found it).
        documents = [json.loads(lines[0])] if len(lines) > 1 else []
    except (ValueError, RecursionError):
        documents = []
    if not documents:
        raise ValueError(f"not OTLP/JSON: {whole_error}") from None
    for number, line in enumerate(lines[1:], 2):
        try:
            documents.append(json.loads(line))
        except RecursionError:
            raise ValueError(
                f"not OTLP/JSON (JSON Lines, line {number}): nested too deeply"
            ) from None
        except ValueError as exc:
            raise ValueError(f"not OTLP/JSON (JSON Lines, line {number}): {exc}") from None
    return documents


def _otlp_spans(data: bytes, fmt: str) -> tuple[list[Any], list[str]]:
    """The spans of an OTLP file, and why each span of a protobuf file that cannot be read was
    left out (a JSON file with such a span is refused whole)."""
    if fmt == "otlp-json":
        spans: list[Any] = []
        for document in _otlp_json_documents(data):
            if not isinstance(document, dict):
                raise ValueError("not OTLP/JSON: expected an object")
            if "resourceSpans" not in document:
                if isinstance(document.get("data"), list):  # /api/traces, as export writes
                    raise ValueError(
                        "this is Jaeger JSON, which import does not read (export the run as "
                        "agentcap-pb or otlp-json to import it)"
                    )
                raise ValueError("not OTLP/JSON: no resourceSpans")
            try:
                spans.extend(spans_from_json(document))
            except (
                AttributeError,
                KeyError,
                OverflowError,
                TypeError,
                ValueError,
                RecursionError,
            ) as exc:
                raise ValueError(f"malformed OTLP/JSON: {exc!r}") from None
        return spans, []
    try:
        from otel_agentcap.ingest.otlp import read_spans
    except ImportError as exc:
        raise ValueError(
            f"not agentcap-pb or OTLP/JSON, and reading OTLP protobuf needs opentelemetry-proto "
            f"({exc})"
        ) from None
    try:
        return read_spans(data)
    except Exception as exc:  # google.protobuf.message.DecodeError
        raise ValueError(f"not agentcap-pb, OTLP/JSON or OTLP protobuf: {exc}") from None


def import_file(database: Database, data: bytes, *, _whole: bool = False) -> ImportResult:
    """Load ``data`` into the log of ``database``; raises ``ValueError`` for a file it cannot read
    (nothing is stored) and ``AgentCapStorageError`` when a write fails: nothing of that write is
    stored, and :class:`ImportIncomplete` when earlier writes were. agentcap-pb goes through
    :func:`import_stream` (``_whole``: read it whole, for a file not in export order)."""
    if not data.strip():
        raise ValueError("the input is empty: nothing to import")
    unmarked = data.removeprefix(_UTF8_BOM)  # JSON saved with a byte order mark
    if unmarked.lstrip()[:1] == b"{":
        data = unmarked
    fmt = detect_format(data)
    if fmt == "agentcap-pb" and not _whole:
        return import_stream(database, io.BytesIO(data))
    result = ImportResult(fmt)
    writer = EventWriter(database.pool)
    try:
        with instrumentation_suppressed():
            database.ensure_schema()
            if fmt == "agentcap-pb":
                # Every run of the file is read before the first is written: a run that cannot
                # be read stores nothing of the others.
                snapshots = []
                for snapshot in agentcap_pb.loads(data):
                    snapshot, spans_left_out = valid_spans(snapshot)
                    snapshot, conflicts_left_out = valid_conflicts(snapshot)
                    if wrapped_attributes(snapshot.run.attributes_json):
                        _count_wrapped_attributes(result, snapshot.run.run_id)
                    result.rejected += spans_left_out + conflicts_left_out
                    snapshots.append(snapshot)
                planned = [(s, _readable_batches(s)) for s in snapshots]
                _import_snapshots(database, writer, planned, result)
            else:
                spans, left_out = _otlp_spans(data, fmt)
                batch = batch_from_spans(spans, raw_payloads=True)
                rejected = [*((None, reason) for reason in left_out), *batch.rejected]
                result.rejected += len(rejected) + batch.unreadable
                if rejected:
                    log_rejected_spans(rejected)
                result.runs.extend(dict.fromkeys(r.run_id for r in batch.runs))
                for run_id in batch.unparsed_attributes:
                    _count_wrapped_attributes(result, run_id)
                if batch.events or batch.agents or batch.spans:
                    _write_otlp(writer, spans, batch, result)
    finally:
        writer.close()
    return result
