"""``PostgresSpanExporter``: the OpenTelemetry SpanExporter that writes the event log.

A batch of spans is split by agent into one part per writer (see ``parallel``), each part mapped
to rows on the calling thread and stored by its writer in one transaction of its own. A part that
fails for a reason that can pass (the server is down, writers contended) is tried again with
backoff; a part the server rejects for what it holds is written in halves, recursively, so only
the spans whose rows it refuses are lost (and counted, and handed to the caller's ``on_rejected``
so a durable queue can keep them).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

import psycopg
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_agentcap import attributes as attr
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.exporters.postgres.database import (
    Database,
    instrumentation_suppressed,
    resolve_dsn,
)
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    ConnectionFailed,
    InvalidBatch,
    InvalidPayload,
    SchemaNotReady,
    WriteFailed,
)
from otel_agentcap.exporters.postgres.one_pass import prepare_spans
from otel_agentcap.exporters.postgres.pacing import paced
from otel_agentcap.exporters.postgres.parallel import DEFAULT_WRITERS, WriterThreads, partition_of
from otel_agentcap.exporters.postgres.recovery import PostgresSpawnRegistry, is_claimed
from otel_agentcap.exporters.postgres.rows import (
    PreparedBatch,
    copy_data,
    prepare,
    span_copy_data,
)
from otel_agentcap.exporters.postgres.writer import EventWriter, RunStartCache, WriteResult
from otel_agentcap.forks import call_in_child_after_fork
from otel_agentcap.model import Batch
from otel_agentcap.pipeline.mapping import SpanLike, batch_from_spans
from otel_agentcap.pipeline.span_attributes import attributes_of
from otel_agentcap.protocols import SpawnClaim

_logger = logging.getLogger(__name__)

#: Objects a forked child inherited and must neither use nor close (they are the parent's).
_left_in_parent: list[object] = []

#: Longest wait between two attempts at a part the server could not take.
MAX_RETRY_DELAY = 2.0
DATABASE_CONDITION = "PostgreSQL"


def write_spans(
    database: Database, writer: EventWriter, spans: Sequence[SpanLike], batch: Batch | None = None
) -> WriteResult:
    """Store the events ``spans`` record: one batch, one transaction, deduplicated.

    Payloads go to PostgreSQL as the JSON text they are on the spans, unparsed (parsing costs
    more than the write); if the server rejects one (text cut by an attribute length limit, say),
    the batch is mapped again with every payload parsed and made safe, which cannot be rejected.
    ``batch`` is the raw-payload mapping of ``spans`` when the caller has it already. Runs with
    instrumentation suppressed; raises ``AgentCapStorageError``.
    """
    if batch is None:
        batch = batch_from_spans(spans, raw_payloads=True)
    if not batch.events and not batch.agents and not batch.spans:
        return WriteResult(0, 0, 0, 0)
    with instrumentation_suppressed():
        database.ensure_schema()
        try:
            return writer.write(batch)
        except InvalidPayload:
            return writer.write(batch_from_spans(spans))


_rejected_lock = threading.Lock()
_rejected_logged_at = 0.0


def log_rejected_spans(rejected: Sequence[tuple[object, str]]) -> None:
    """Log spans the mapping left out, at most once every 10 s (each one is counted)."""
    global _rejected_logged_at
    now = time.monotonic()
    with _rejected_lock:
        if now - _rejected_logged_at < 10:
            return
        _rejected_logged_at = now
    _logger.warning(
        "agentcap: %d span(s) of a batch could not be read as event records and were left out, "
        "e.g.: %s",
        len(rejected),
        "; ".join(sorted({reason for _, reason in rejected})[:3]),
    )


@dataclass
class ExportStats:
    """Counters of what the exporter did; read them with :meth:`PostgresSpanExporter.stats`
    (and, with the durable queue, ``AgentCap.stats()``, which adds the queue's figures)."""

    batches: int = 0
    events_inserted: int = 0
    duplicates: int = 0
    conflicts: int = 0
    #: Attempts that failed and were retried (the server down, writers contending).
    failed_attempts: int = 0
    failed_batches: int = 0
    #: Events not stored: rejected by the server for what they hold, or (without the durable
    #: queue) still failing when the exporter's retry deadline passed.
    events_failed: int = 0
    #: Spans dropped before export because the export queue was full (see ``exporters.queue``
    #: and ``exporters.durable``), and the events they held.
    spans_dropped: int = 0
    events_dropped: int = 0
    #: Closing events whose record an attribute value length limit cut (``Batch.unreadable``).
    events_unreadable: int = 0
    #: Spans whose agentcap attributes could not be read as records (``Batch.rejected``), and
    #: events, agent rows and run rows that broke a validation rule (``otel_agentcap.validation``):
    #: left out, logged, the rest of their batch stored.
    spans_rejected: int = 0
    events_rejected: int = 0
    records_rejected: int = 0
    #: Agent or run records that differ from the stored rows (kept in record_conflicts).
    record_conflicts: int = 0
    #: Batch shares the one pass (``one_pass``) failed on with an unexpected exception although
    #: the general path found nothing wrong in them: stored by the general path (a bug, logged
    #: once).
    one_pass_failures: int = 0
    #: The durable queue's figures (zero without it): spans waiting on disk (or in memory when
    #: the disk failed) and their bytes on disk; spans appended since start; spans found in
    #: queues that ended processes left, and taken over; spans kept in memory because the disk
    #: refused them; failed disk operations; spans the database refuses for good (kept in the
    #: queue's ``rejected`` directory, ``spans_refused``); bytes of torn or damaged records
    #: skipped at recovery;
    #: spans left on disk by the last shutdown or flush that ran out of time.
    spans_queued: int = 0
    bytes_queued: int = 0
    spans_enqueued: int = 0
    spans_adopted: int = 0
    spans_in_memory: int = 0
    disk_errors: int = 0
    spans_refused: int = 0
    bytes_corrupt: int = 0
    spans_left: int = 0
    #: Events not stored because their run started before the retention watermark, or was
    #: removed by ``otel-agentcap db prune`` (a late redelivery).
    events_expired: int = 0
    #: ``agent_spawn`` events recorded while the spawn registry did not answer, left out at
    #: delivery because another process had registered the same child first (its spawn event
    #: is the child's; this one would have been a conflict).
    spawns_superseded: int = 0


def _share_run_starts(parts: Sequence[Part]) -> None:
    """Give every part's row of a run the earliest start the whole batch knows for it: the log
    keeps the start of the first row it stores (first writer wins), and the parts are stored
    concurrently, so without this a run's start would depend on which part commits first."""
    earliest: dict[str, datetime] = {}
    for part in parts:
        if part.prepared is None:
            continue
        for run in part.prepared.runs:
            start = run[1]
            if start is not None and (run[0] not in earliest or start < earliest[run[0]]):
                earliest[run[0]] = start
    for part in parts:
        if part.prepared is not None and part.prepared.runs:
            part.prepared = replace(
                part.prepared,
                runs=[
                    (run[0], earliest.get(run[0], run[1]), run[2], run[3], run[4])
                    for run in part.prepared.runs
                ],
            )


@dataclass
class Part:
    """The spans of one batch that one writer stores, mapped and prepared."""

    writer: int
    spans: list[SpanLike]
    #: What the caller gave for each span (its queue record, say), handed back if rejected.
    records: list[object] | None = None
    batch: Batch = field(default_factory=Batch)
    prepared: PreparedBatch | None = None
    #: The rows' COPY data for the path ``direct`` names (built with the rows, on the caller's
    #: thread, so the writer's thread only sends it).
    data: bytes | None = None
    span_data: bytes | None = None
    #: The run starts ``data`` and ``span_data`` were built with (None: not built).
    starts: dict[str, datetime] | None = None
    direct: bool = False
    error: AgentCapStorageError | None = None
    #: The spawns its spans recorded while the registry did not answer are registered now.
    spawns_registered: bool = False
    #: How many events the spans hold, when they were prepared without a ``batch``
    #: (``one_pass``).
    mapped: int | None = None
    #: What the one pass raised for spans the general path then mapped without finding
    #: anything wrong in them (a bug of the one pass: counted and logged by the exporter).
    one_pass_failure: Exception | None = None

    @property
    def events(self) -> int:
        if self.mapped is not None:
            return self.mapped
        return len(self.batch.events) + len(self.batch.superseded)


@dataclass
class PartOutcome:
    """What storing a part did. ``done`` is false when it was given up (deadline or stop) with
    nothing of it known to be stored."""

    done: bool
    inserted: int = 0
    duplicates: int = 0
    conflicts: int = 0
    failed_events: int = 0
    rejected_records: list[object] = field(default_factory=list)
    rejected_reason: str = ""
    pending_events: int = 0
    #: Left out by validation (``otel_agentcap.validation``), and run or agent records that
    #: differ from the stored rows (``WriteResult``).
    events_rejected: int = 0
    records_rejected: int = 0
    record_conflicts: int = 0
    #: Events of runs the log no longer takes (``WriteResult.expired``).
    events_expired: int = 0

    def add(self, other: PartOutcome) -> None:
        self.done = self.done and other.done
        self.inserted += other.inserted
        self.duplicates += other.duplicates
        self.conflicts += other.conflicts
        self.failed_events += other.failed_events
        self.rejected_records.extend(other.rejected_records)
        self.rejected_reason = self.rejected_reason or other.rejected_reason
        self.pending_events += other.pending_events
        self.events_rejected += other.events_rejected
        self.records_rejected += other.records_rejected
        self.record_conflicts += other.record_conflicts
        self.events_expired += other.events_expired


def _map(
    spans: Sequence[SpanLike], *, raw_payloads: bool, pause: Callable[[], None] | None = None
) -> Batch:
    """``batch_from_spans``, for spans the durable queue may have sent in two records (an
    agent's ``invoke_agent`` span, whose ``agent_start`` is queued when it starts): a span that
    has not ended (``end_time`` None, a start record) gives no envelope, which would be stored
    first and keep the span's end from the log; the own event of a span that says it was sent
    already (``own_event_queued``) is left out, except once when the record that sent it is in
    this very batch. ``pause`` is called between slices of the mapping (``pacing.paced``)."""
    batch = batch_from_spans(paced(spans, pause), raw_payloads=raw_payloads)
    if not any(
        getattr(span, "own_event_queued", False) or getattr(span, "end_time", 0) is None
        for span in spans
    ):
        return batch  # the common case: every span ended, none sent before
    sent: set[object] = set()
    here: set[object] = set()
    started: set[tuple[str, str]] = set()
    for span in spans:
        if getattr(span, "own_event_queued", False):
            sent.add(attributes_of(span).get(attr.EVENT_ID))
        elif getattr(span, "end_time", 0) is None:
            here.add(attributes_of(span).get(attr.EVENT_ID))
            context = span.context
            if context is not None:
                started.add((f"{context.trace_id:032x}", f"{context.span_id:016x}"))
        else:
            here.add(attributes_of(span).get(attr.EVENT_ID))
    if started:
        # The envelope a start record gives ends where it starts; the ended span's, later.
        batch = batch._replace(
            spans=tuple(
                e
                for e in batch.spans
                if (e.trace_id, e.span_id) not in started or e.end_time > e.start_time
            )
        )
    if not sent:
        return batch
    kept: set[object] = set()
    events = []
    for event in batch.events:
        if event.event_id in sent:
            if event.event_id not in here or event.event_id in kept:
                continue
            kept.add(event.event_id)
        events.append(event)
    return batch._replace(events=tuple(events))


def map_part(
    part: Part, run_starts: RunStartCache, pause: Callable[[], None] | None = None
) -> Part:
    """Map ``part``'s spans to rows (CPU work, on the caller's thread): in one pass when every
    span is of the common kind (``one_pass``), else mapped, prepared and encoded step by step.
    The rows carry their run's start: their COPY data is built here when every run's start is
    known (a start never changes once stored); otherwise the writer builds it once it has read
    the starts, in its transaction. A part that cannot be mapped gets its ``error``. ``pause``
    is called now and then while the spans are mapped (``WriterThreads.pause``)."""
    spans = part.spans
    direct = part.direct
    try:
        failures: list[Exception] = []
        one = prepare_spans(
            spans,
            staging=not direct,
            known_start=run_starts.start,
            failures=failures,
            pause=pause,
        )
        if one is not None:
            part.prepared, part.mapped, part.data, part.span_data, part.starts = one
            return part
        part.batch = _map(spans, raw_payloads=True, pause=pause)
        part.prepared = prepare(part.batch)
        part.starts = run_starts.known(r[0] for r in part.prepared.runs)
        if part.starts is not None:
            if part.prepared.events:
                part.data = copy_data(part.prepared.events, staging=not direct, starts=part.starts)
            if part.prepared.spans:
                part.span_data = span_copy_data(part.prepared.spans, starts=part.starts)
        if failures and not (
            part.batch.rejected or part.batch.unreadable or part.prepared.rejected
        ):
            # Nothing the general path reports explains the exception.
            part.one_pass_failure = failures[0]
    except InvalidBatch as exc:
        part.error = exc
    except Exception as exc:  # a bug of ours must not stop delivery: treat as rejected
        _logger.exception("agentcap: mapping %d spans failed", len(spans))
        part.error = WriteFailed(f"mapping failed: {exc!r}")
    return part


def _spawn_claim(span: SpanLike, attributes: Any) -> SpawnClaim | None:
    """The registration of the spawn an ``agent_spawn`` span recorded (None if it holds none)."""
    try:
        payload = attributes.get(attr.EVENT_PAYLOAD)
        key = json.loads(payload).get("key") if isinstance(payload, str) else None
    except (ValueError, AttributeError):
        key = None
    context = span.context
    run_id = attributes.get(attr.RUN_ID)
    child = attributes.get(attr.CHILD_AGENT_ID)
    parent = attributes.get(attr.AGENT_ID)
    event_id = attributes.get(attr.EVENT_ID)
    seq = attributes.get(attr.EVENT_SEQ)
    if not (
        isinstance(run_id, str)
        and isinstance(child, str)
        and isinstance(parent, str)
        and isinstance(event_id, str)
        and isinstance(seq, int)
    ):
        return None
    name = attributes.get(attr.CHILD_AGENT_NAME)
    valid = context is not None and bool(context.trace_id) and bool(context.span_id)
    return SpawnClaim(
        run_id,
        child,
        parent,
        name if isinstance(name, str) else "",
        key if isinstance(key, str) else None,
        event_id,
        seq,
        f"{context.trace_id:032x}" if valid and context is not None else None,
        f"{context.span_id:016x}" if valid and context is not None else None,
    )


class PostgresSpanExporter(SpanExporter):
    """Writes agentcap events to PostgreSQL, deduplicated, one transaction per part (the events
    of one batch that one writer stores; ``writers`` writers in parallel, split by agent).

    With no arguments (as ``OTEL_TRACES_EXPORTER=agentcap`` creates it) the DSN comes from
    ``AGENTCAP_DSN``, else an embedded server is started. In ``export`` a failed write is retried
    with backoff for up to ``retry_timeout`` seconds; after that the batch is reported as FAILURE,
    logged and counted (``stats().events_failed``). ``export`` never raises. The durable queue
    (``exporters.durable``) uses :meth:`prepare_parts` and :meth:`submit` instead, and retries
    until its data is stored.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        database: Database | None = None,
        owns_database: bool | None = None,
        retry_timeout: float = 10.0,
        writers: int = DEFAULT_WRITERS,
        faults: FaultLog | None = None,
    ) -> None:
        self._database = database if database is not None else Database(resolve_dsn(dsn))
        # By default the exporter closes the pool at shutdown only if it opened it.
        self._owns_database = database is None if owns_database is None else owns_database
        self._retry_timeout = retry_timeout
        self._writers = WriterThreads(
            self._database.dsn,
            writers,
            # A connection attempt longer than the retry deadline would hold export past it.
            connect_timeout=max(2.0, min(10.0, retry_timeout)),
        )
        self.faults = faults if faults is not None else FaultLog()
        self._stats = ExportStats()
        self._stats_lock = threading.Lock()
        self._shutdown = threading.Event()
        self._spawns = PostgresSpawnRegistry(self._database)
        call_in_child_after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        """A forked child has none of the writer threads, and must not use the parent's
        connections: it gets writers of its own (the parent's objects are left untouched)."""
        _left_in_parent.append(self._writers)
        self._stats_lock = threading.Lock()
        self._writers = WriterThreads(
            self._database.dsn,
            self._writers.count,
            connect_timeout=max(2.0, min(10.0, self._retry_timeout)),
        )

    @property
    def database(self) -> Database:
        return self._database

    @property
    def writer_count(self) -> int:
        return self._writers.count

    def pause_for_writers(self) -> None:
        """For a thread that maps or decodes spans for :meth:`prepare_parts` while earlier parts
        are stored: call it between slices of that work (see ``WriterThreads.pause``)."""
        self._writers.pause()

    def stats(self) -> ExportStats:
        with self._stats_lock:
            return ExportStats(**asdict(self._stats))

    def count_dropped(self, span: ReadableSpan | None = None, events: int | None = None) -> None:
        """Count a span the export queue in front of this exporter dropped, and its events
        (``events`` when the caller knows them, else mapped from ``span``)."""
        if events is None:
            try:
                events = len(batch_from_spans([span]).events) if span is not None else 0
            except Exception:
                events = 0
        with self._stats_lock:
            self._stats.spans_dropped += 1
            self._stats.events_dropped += events

    # --- the parts of a batch ---------------------------------------------------------------

    def prepare_parts(
        self,
        spans: Sequence[SpanLike],
        records: Sequence[object] | None = None,
        *,
        direct: bool = False,
    ) -> list[Part]:
        """Split ``spans`` by writer and map each share to rows (CPU work, on the caller's
        thread). ``records`` stand for the spans in the caller's terms (their queue records,
        say), in the same order: a span the server rejects for good is handed back as its
        record."""
        count = self._writers.count
        shares: list[list[SpanLike]] = [[] for _ in range(count)]
        record_shares: list[list[object]] | None = (
            [[] for _ in range(count)] if records is not None else None
        )
        for i, span in enumerate(spans):
            attributes = attributes_of(span)
            index = partition_of(attributes.get(attr.RUN_ID), attributes.get(attr.AGENT_ID), count)
            shares[index].append(span)
            if record_shares is not None and records is not None:
                record_shares[index].append(records[i])
        parts = []
        for index, share in enumerate(shares):
            if share:
                parts.append(
                    self._part(
                        index, share, record_shares[index] if record_shares else None, direct
                    )
                )
        if len(parts) > 1:
            _share_run_starts(parts)
        return parts

    def _part(
        self,
        index: int,
        spans: list[SpanLike],
        records: list[object] | None,
        direct: bool = False,
    ) -> Part:
        writers = self._writers
        part = map_part(
            Part(index, spans, records, direct=direct), writers.run_starts, writers.pause
        )
        failure = part.one_pass_failure
        if failure is not None:
            with self._stats_lock:
                first = self._stats.one_pass_failures == 0
                self._stats.one_pass_failures += 1
            if first:
                _logger.error(
                    "agentcap: the one pass failed on %d spans that the general path maps "
                    "(they are stored, more slowly; stats().one_pass_failures counts such "
                    "batches, this is logged once): %r",
                    len(spans),
                    failure,
                    exc_info=failure,
                )
        return part

    def submit(
        self,
        parts: Sequence[Part],
        *,
        direct: bool = False,
        deadline: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Future[PartOutcome]]:
        """Hand each part to its writer. A part is retried until it is stored, rejected for good
        (in halves, down to single spans), or the ``deadline`` (monotonic) passes or ``stop`` is
        set; ``direct`` lets a first attempt copy straight into the events table."""
        stop_event = stop if stop is not None else self._shutdown
        return [
            self._writers.submit(
                part.writer,
                functools.partial(
                    self._store, part=part, direct=direct, deadline=deadline, stop=stop_event
                ),
            )
            for part in parts
        ]

    def settle(self, parts: Sequence[Part], outcomes: Sequence[PartOutcome]) -> bool:
        """Count what storing ``parts`` did (once per batch); whether all of it is stored."""
        done = all(o.done for o in outcomes)
        failed = sum(o.failed_events for o in outcomes)
        unreadable = sum(p.batch.unreadable for p in parts)
        rejected_spans = [r for p in parts for r in p.batch.rejected]
        with self._stats_lock:
            stats = self._stats
            stats.events_inserted += sum(o.inserted for o in outcomes)
            stats.duplicates += sum(o.duplicates for o in outcomes)
            stats.conflicts += sum(o.conflicts for o in outcomes)
            stats.events_failed += failed
            stats.events_unreadable += unreadable
            stats.spans_rejected += len(rejected_spans)
            stats.events_rejected += sum(o.events_rejected for o in outcomes)
            stats.records_rejected += sum(o.records_rejected for o in outcomes)
            stats.record_conflicts += sum(o.record_conflicts for o in outcomes)
            stats.events_expired += sum(o.events_expired for o in outcomes)
            if failed:
                stats.failed_batches += 1
            elif done:
                stats.batches += 1
        conflicts = sum(o.conflicts for o in outcomes)
        if conflicts:
            _logger.error(
                "agentcap: %d events collided with different stored events; kept in "
                "agentcap.conflicts",
                conflicts,
            )
        if rejected_spans:
            log_rejected_spans(rejected_spans)
        return done and not failed

    def _store(
        self,
        writer: EventWriter,
        part: Part,
        direct: bool,
        deadline: float | None,
        stop: threading.Event,
    ) -> PartOutcome:
        prepared = part.prepared
        if prepared is not None and not (
            prepared.events or prepared.agents or prepared.runs or prepared.spans
        ):
            return PartOutcome(True)
        delay = 0.05
        reparsed = False
        while True:
            try:
                if part.error is not None:
                    raise part.error
                if not part.spawns_registered:
                    part = self._register_spawns(part)
                assert part.prepared is not None
                if not (
                    part.prepared.events
                    or part.prepared.agents
                    or part.prepared.runs
                    or part.prepared.spans
                ):
                    return PartOutcome(True)
                with instrumentation_suppressed():
                    self._database.ensure_schema()
                    result = writer.write_prepared(
                        part.prepared,
                        direct=direct,
                        data=part.data if part.direct == direct else None,
                        span_data=part.span_data,
                        starts=part.starts,
                    )
            except InvalidPayload:
                if reparsed:
                    return self._rejected(writer, part, direct, deadline, stop, "invalid payload")
                # Payload text the server refuses as JSON (cut by a length limit, say): map again
                # with every payload parsed and made safe.
                reparsed = True
                part = Part(part.writer, part.spans, part.records, part.batch, direct=direct)
                try:
                    part.batch = _map(part.spans, raw_payloads=False)
                    part.prepared = prepare(part.batch)
                except InvalidBatch as exc:
                    part.error = exc
                continue
            except AgentCapStorageError as exc:
                direct = False  # the next attempt may meet rows this one stored
                if isinstance(exc, SchemaNotReady):
                    self._database.forget_schema()  # migrate again before the next attempt
                elif not exc.retryable:
                    return self._rejected(writer, part, direct, deadline, stop, str(exc))
                with self._stats_lock:
                    self._stats.failed_attempts += 1
                self.faults.fault(
                    DATABASE_CONDITION,
                    f"cannot store events ({exc})",
                    consequence="retrying with backoff",
                )
                now = time.monotonic()
                if stop.is_set() or (deadline is not None and now + delay > deadline):
                    return PartOutcome(False, pending_events=part.events)
                stop.wait(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY)
                continue
            self.faults.recovered(DATABASE_CONDITION)
            return PartOutcome(
                True,
                result.inserted,
                result.duplicates,
                result.conflicts,
                events_rejected=result.rejected,
                records_rejected=result.rejected_records,
                record_conflicts=result.record_conflicts,
                events_expired=result.expired,
            )

    def _register_spawns(self, part: Part) -> Part:
        """Register in ``agentcap.spawns`` the spawns the part's spans recorded while the
        registry did not answer (``agentcap.spawn.unregistered``), before their events are
        stored. A spawn another process registered first (the same child recorded twice during
        an outage) is left out with its span: the registered one is the child's, and this event
        would only be a conflict. Raises ``ConnectionFailed`` (retried) when the database does
        not answer."""
        lost: set[int] = set()
        for index, span in enumerate(part.spans):
            attributes = attributes_of(span)
            if attributes.get(attr.SPAWN_UNREGISTERED) is not True:
                continue
            claim = _spawn_claim(span, attributes)
            if claim is None:
                continue
            try:
                with instrumentation_suppressed():
                    record = self._spawns.register(claim)
            except AgentCapStorageError:
                raise
            except psycopg.OperationalError as exc:
                raise ConnectionFailed(f"cannot register a spawn: {exc}") from exc
            except psycopg.Error as exc:
                # Not for want of a connection (a pruned run, say): the event is stored, or
                # refused, as any other.
                _logger.warning("agentcap: could not register the spawn of %s (%s)", claim[1], exc)
                continue
            if not is_claimed(record.spawned_at, claim):
                lost.add(index)
        if not lost:
            part.spawns_registered = True
            return part
        _logger.info(
            "agentcap: %d spawn(s) recorded while the spawn registry did not answer were "
            "registered first by another process; their agent_spawn events are left out",
            len(lost),
        )
        with self._stats_lock:
            self._stats.spawns_superseded += len(lost)
        records = part.records
        rebuilt = self._part(
            part.writer,
            [s for i, s in enumerate(part.spans) if i not in lost],
            None if records is None else [r for i, r in enumerate(records) if i not in lost],
            part.direct,
        )
        rebuilt.spawns_registered = True
        if rebuilt.error is not None:
            raise rebuilt.error
        return rebuilt

    def _rejected(
        self,
        writer: EventWriter,
        part: Part,
        direct: bool,
        deadline: float | None,
        stop: threading.Event,
        reason: str,
    ) -> PartOutcome:
        """The server refuses ``part`` for what it holds: store its halves apart, so only the
        spans whose rows it refuses are lost (and handed back as records)."""
        with self._stats_lock:
            self._stats.failed_attempts += 1
        if len(part.spans) <= 1:
            events = part.events if part.error is None else max(part.events, 1)
            _logger.error(
                "agentcap: could not store %d event(s) of span %r (%s)",
                events,
                getattr(part.spans[0], "name", "?") if part.spans else "?",
                reason,
            )
            return PartOutcome(
                True,
                failed_events=events,
                rejected_records=list(part.records or ()),
                rejected_reason=reason,
            )
        _logger.warning(
            "agentcap: %d spans were rejected together (%s); writing them in halves",
            len(part.spans),
            reason,
        )
        middle = len(part.spans) // 2
        records = part.records
        outcome = PartOutcome(True)
        for spans, share in (
            (part.spans[:middle], records[:middle] if records is not None else None),
            (part.spans[middle:], records[middle:] if records is not None else None),
        ):
            outcome.add(
                self._store(writer, self._part(part.writer, spans, share), direct, deadline, stop)
            )
        return outcome

    # --- SpanExporter -------------------------------------------------------------------------

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown.is_set():
            return SpanExportResult.FAILURE
        try:
            return self._export(spans)
        except Exception:  # a bug of ours must not reach the BatchSpanProcessor's thread
            _logger.exception("agentcap: export failed unexpectedly")
            return SpanExportResult.FAILURE

    def _export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        parts = self.prepare_parts(spans, direct=True)
        if not parts:
            return SpanExportResult.SUCCESS
        deadline = time.monotonic() + self._retry_timeout
        futures = self.submit(parts, direct=True, deadline=deadline)
        outcomes = [future.result() for future in futures]
        for outcome in outcomes:
            if outcome.pending_events:
                outcome.failed_events += outcome.pending_events
                _logger.error(
                    "agentcap: could not store %d events within %.0f s; giving up on them",
                    outcome.pending_events,
                    self._retry_timeout,
                )
        ok = self.settle(parts, outcomes)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop: parts still being retried give up, the writers' connections close (a writer
        busy on an unresponsive server is left to end alone after ``timeout`` seconds)."""
        self._shutdown.set()
        self._writers.close(timeout)
        if self._owns_database:
            self._database.close()
