"""What the OTLP ingest does with a decoded request, whatever the transport: check each span,
store the good ones, and say which were rejected and why.

Per request (:meth:`IngestService.process`):

- spans without ``agentcap.event.id`` (other than runs' root spans) are accepted and ignored
  (counted: a collector may send every span of an application);
- a span that cannot be read, that breaks a validation rule (``otel_agentcap.validation``), or
  that names a run its token may not write is rejected alone, with a reason;
- the other spans are mapped and stored in chunks (one transaction each); a chunk the database
  refuses for its values is written in halves until only the spans it refuses are left, which
  are rejected alone;
- if the database is unreachable or a writer keeps contending, processing stops and the request
  is to be answered "retry later" (chunks already stored are deduplicated when it is sent again).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.exporters.postgres.database import Database, instrumentation_suppressed
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    DataRejected,
    InvalidPayload,
)
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult
from otel_agentcap.ingest.otlp import OtlpSpan
from otel_agentcap.ingest.wire import DecodedRequest
from otel_agentcap.model import AgentRecord, Batch, Event
from otel_agentcap.pipeline.mapping import SpanCheck, SpanLike, batch_from_spans
from otel_agentcap.pipeline.span_attributes import attributes_of
from otel_agentcap.tokens import ANONYMOUS, Principal
from otel_agentcap.validation import Validator

_logger = logging.getLogger(__name__)

#: Spans mapped and stored per transaction (a request of more is pipelined: see ``process``).
DEFAULT_CHUNK_SPANS: Final = 2_000
#: Distinct reasons listed in a response's message.
_MAX_REASONS: Final = 5


@dataclass
class IngestStats:
    """Counters of an ingest server; read them with ``OtlpIngestServer.stats()``."""

    requests: int = 0
    batches: int = 0
    events_inserted: int = 0
    duplicates: int = 0
    conflicts: int = 0
    #: Agent or run records that differ from the stored rows (kept in record_conflicts).
    record_conflicts: int = 0
    spans_received: int = 0
    #: Spans without agentcap attributes: accepted, not stored.
    spans_ignored: int = 0
    #: Spans rejected alone (answered in partial_success).
    spans_rejected: int = 0
    #: Closing events whose record was cut before its identity (see ``Batch.unreadable``).
    events_unreadable: int = 0
    #: Run attribute declarations (``agentcap.run.attributes``) that are not a JSON object:
    #: stored as ``{"$agentcap.unparsed": text}``, their exact text, as ``import`` stores them;
    #: counted once per run and chunk of a request (each logged).
    unparsed_attributes: int = 0
    #: Event payloads that are not JSON (cut by a length limit, say): stored as
    #: ``{"$agentcap.unparsed": text}`` markers, as ``import`` stores them (and counts them).
    unparsed_payloads: int = 0
    rejected_requests: int = 0
    """Answered 4xx: undecodable, too large, unsupported, unauthorized."""
    unauthorized_requests: int = 0
    failed_requests: int = 0
    """Answered 503 (retry): the database was unavailable, or the server was saturated."""
    #: Events not stored because their run started before the retention watermark, or was
    #: removed by ``db prune`` (a late redelivery).
    events_expired: int = 0


class RetryLater(Exception):
    """The request could not be processed now; the sender should send it again later."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Outcome:
    """What became of one request's spans (updated by the request's thread and its write
    thread, under ``lock``)."""

    received: int = 0
    ignored: int = 0
    rejected: int = 0
    batches: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    result: WriteResult = field(default_factory=lambda: WriteResult(0, 0, 0, 0))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def reject(self, reason: str, count: int = 1) -> None:
        with self.lock:
            self.rejected += count
            self.reasons[reason] += count

    def ignore(self) -> None:
        with self.lock:
            self.ignored += 1

    def stored(self, result: WriteResult) -> None:
        with self.lock:
            self.batches += 1
            self.result = _add(self.result, result)

    def message(self) -> str:
        """The ``partial_success.error_message``: how many spans were rejected and why."""
        if not self.rejected:
            return ""
        parts = [
            f"{reason} ({n} span{'s' if n > 1 else ''})"
            for reason, n in self.reasons.most_common(_MAX_REASONS)
        ]
        more = len(self.reasons) - _MAX_REASONS
        text = f"{self.rejected} of {self.received} spans rejected: " + "; ".join(parts)
        if more > 0:
            text += f"; and {more} other reason(s)"
        return text[:4096]


def _add(total: WriteResult, result: WriteResult) -> WriteResult:
    return WriteResult(
        total.inserted + result.inserted,
        total.duplicates + result.duplicates,
        total.conflicts + result.conflicts,
        total.attempts + result.attempts,
        rejected=total.rejected + result.rejected,
        record_conflicts=total.record_conflicts + result.record_conflicts,
        rejected_records=total.rejected_records + result.rejected_records,
        expired=total.expired + result.expired,
    )


def span_check(principal: Principal, validator: Validator) -> SpanCheck:
    """The per-span check of the ingest: the storage validation rules, and the token's runs."""

    def check(
        span: SpanLike,
        events: Sequence[Event],
        agents: Sequence[AgentRecord],
        run_attributes: Mapping[str, Any] | None,
        root_run: str | None,
    ) -> str | None:
        if root_run is not None:  # a run's root span: its run and its start are stored
            reason = validator.id_reason(root_run, "run id") or validator.time_reason(
                datetime.fromtimestamp((span.start_time or 0) / 1e9, tz=UTC), "run start"
            )
            if reason is not None:
                return reason
            if not principal.allows(root_run):
                return f"{principal.name} may not write run {root_run[:200]!r}"
        for event in events:
            reason = validator.event(event)
            if reason is not None:
                return reason
            if not principal.allows(event.run_id):
                return f"{principal.name} may not write run {event.run_id[:200]!r}"
        for record in agents:
            reason = validator.agent(record)
            if reason is not None:
                return reason
            if not principal.allows(record.run_id):
                return f"{principal.name} may not write run {record.run_id[:200]!r}"
        return None

    return check


class IngestService:
    """Stores decoded requests through one ``EventWriter``; thread-safe."""

    def __init__(
        self,
        database: Database,
        writer: EventWriter,
        *,
        chunk_spans: int = DEFAULT_CHUNK_SPANS,
        retry_after: int = 5,
        max_writes: int = 8,
    ) -> None:
        if chunk_spans < 1:
            raise ValueError("chunk_spans must be at least 1")
        self._database = database
        self._writer = writer
        self._chunk_spans = chunk_spans
        self._retry_after = retry_after
        self._stats = IngestStats()
        self._lock = threading.Lock()
        # One write in flight per request at most: as many writers as requests at once.
        self._writes = ThreadPoolExecutor(
            max_workers=max_writes, thread_name_prefix="agentcap-ingest-write"
        )

    def close(self) -> None:
        """Wait for writes in flight and stop the write threads."""
        self._writes.shutdown(wait=True)

    def stats(self) -> IngestStats:
        with self._lock:
            return IngestStats(**asdict(self._stats))

    def count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def process(self, request: DecodedRequest, principal: Principal = ANONYMOUS) -> Outcome:
        """Check and store the spans of ``request``; raises ``RetryLater`` when the database
        cannot take them now.

        Chunks are pipelined: while one chunk is written (the thread waits on PostgreSQL), the
        next is decoded and mapped in this thread; at most one write is in flight, so a request
        holds at most two mapped chunks."""
        outcome = Outcome(received=request.count)
        check = span_check(principal, Validator())
        chunk: list[OtlpSpan] = []
        writing: Future[None] | None = None
        try:
            for span, reason in request.items():
                if span is None:
                    if reason is None:  # no agentcap event id: not for the log
                        outcome.ignore()
                    else:
                        outcome.reject(reason)
                    continue
                attributes = attributes_of(span)
                if attr.EVENT_ID not in attributes and attributes.get(attr.RUN_ROOT) is not True:
                    outcome.ignore()
                    continue
                chunk.append(span)
                if len(chunk) >= self._chunk_spans:
                    writing = self._pipeline(writing, chunk, check, outcome)
                    chunk = []
            if chunk:
                writing = self._pipeline(writing, chunk, check, outcome)
            if writing is not None:
                done, writing = writing, None
                done.result()
        finally:
            if writing is not None:  # stopped early: let the write in flight end first
                with contextlib.suppress(Exception):
                    writing.result()
            result = outcome.result
            self.count(
                spans_received=outcome.received,
                spans_ignored=outcome.ignored,
                spans_rejected=outcome.rejected,
                events_inserted=result.inserted,
                duplicates=result.duplicates,
                conflicts=result.conflicts,
                record_conflicts=result.record_conflicts,
                events_expired=result.expired,
                batches=outcome.batches,
            )
        if outcome.rejected:
            _logger.warning("agentcap ingest: %s", outcome.message())
        return outcome

    def _pipeline(
        self,
        writing: Future[None] | None,
        spans: list[OtlpSpan],
        check: SpanCheck,
        outcome: Outcome,
    ) -> Future[None]:
        """Map ``spans`` (while the previous chunk is written), wait for that write, then start
        writing this chunk; raises what the previous write raised (``RetryLater``)."""
        batch = batch_from_spans(spans, raw_payloads=True, check=check)
        for _, reason in batch.rejected:
            outcome.reject(reason)
        if batch.unreadable:
            self.count(events_unreadable=batch.unreadable)
        if batch.unparsed_attributes:
            self.count(unparsed_attributes=len(batch.unparsed_attributes))
            _logger.warning(
                "agentcap ingest: the attributes declared for run(s) %s are not a JSON object; "
                'stored as {"$agentcap.unparsed": text}, their exact text',
                ", ".join(repr(run_id[:200]) for run_id in batch.unparsed_attributes[:5]),
            )
        if batch.rejected:
            rejected = {index for index, _ in batch.rejected}
            spans = [s for i, s in enumerate(spans) if i not in rejected]
        if writing is not None:
            writing.result()
        return self._writes.submit(self._store, spans, batch, check, outcome)

    def _store(
        self, spans: Sequence[OtlpSpan], batch: Batch, check: SpanCheck, outcome: Outcome
    ) -> None:
        if not batch.events and not batch.agents:
            return
        try:
            result = self._write(spans, batch, check)
        except (DataRejected, AgentCapStorageError) as exc:
            if not isinstance(exc, DataRejected):
                _logger.warning("agentcap ingest: cannot store now, asking to retry: %s", exc)
                raise RetryLater(
                    f"the event log is unavailable: {_first_line(exc)}", self._retry_after
                ) from exc
            self._split(spans, check, outcome, f"the database refused the span: {_first_line(exc)}")
            return
        except Exception as exc:  # a bug of ours: isolate the span that triggers it
            _logger.exception("agentcap ingest: storing %d span(s) failed unexpectedly", len(spans))
            self._split(spans, check, outcome, f"internal error: {type(exc).__name__}")
            return
        if result.rejected or result.rejected_records:  # the check applies the same rules
            outcome.reject("a record broke a validation rule", result.rejected)
        outcome.stored(result)

    def _split(
        self, spans: Sequence[OtlpSpan], check: SpanCheck, outcome: Outcome, reason: str
    ) -> None:
        """Write ``spans`` in halves, down to the spans that cannot be stored, rejected alone."""
        if len(spans) == 1:
            outcome.reject(reason)
            return
        middle = len(spans) // 2
        for half in (spans[:middle], spans[middle:]):
            self._store(
                half, batch_from_spans(half, raw_payloads=True, check=check), check, outcome
            )

    def _write(self, spans: Sequence[OtlpSpan], batch: Batch, check: SpanCheck) -> WriteResult:
        with instrumentation_suppressed():
            self._database.ensure_schema()
            # Every record passed ``check``, which applies the writer's validation rules.
            try:
                return self._writer.write(batch, validated=True)
            except InvalidPayload:
                # A payload that is not the JSON it claims (cut by a length limit): map again
                # with every payload parsed and made safe.
                result = self._writer.write(batch_from_spans(spans, check=check), validated=True)
        # Only here (payloads are not parsed on the common path): the markers it stored.
        marked = sum(
            1
            for e in batch.events
            if isinstance(e.payload, jsonsafe.RawJson) and jsonsafe.gives_marker(e.payload)
        )
        if marked:
            self.count(unparsed_payloads=marked)
            _logger.warning(
                "agentcap ingest: %d payload(s) are not JSON; stored as "
                '{"$agentcap.unparsed": text} markers',
                marked,
            )
        return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


__all__ = [
    "DEFAULT_CHUNK_SPANS",
    "IngestService",
    "IngestStats",
    "Outcome",
    "RetryLater",
    "span_check",
]
