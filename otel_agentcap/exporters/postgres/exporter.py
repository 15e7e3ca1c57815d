"""``PostgresSpanExporter``: the OpenTelemetry SpanExporter that writes the event log."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_agentcap.exporters.postgres.database import (
    Database,
    instrumentation_suppressed,
    resolve_dsn,
)
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    InvalidPayload,
    WriteFailed,
)
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult
from otel_agentcap.mapping import SpanLike, batch_from_spans
from otel_agentcap.model import Batch

_logger = logging.getLogger(__name__)


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


def _log_rejected_spans(batch: Batch) -> None:
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
        len(batch.rejected),
        "; ".join(sorted({reason for _, reason in batch.rejected})[:3]),
    )


@dataclass
class ExportStats:
    """Counters of what the exporter did; read them with :meth:`PostgresSpanExporter.stats`."""

    batches: int = 0
    events_inserted: int = 0
    duplicates: int = 0
    conflicts: int = 0
    failed_attempts: int = 0
    failed_batches: int = 0
    events_failed: int = 0
    #: Spans dropped before export because the export queue was full (see ``exporters.queue``),
    #: and the events they held.
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


class PostgresSpanExporter(SpanExporter):
    """Writes agentcap events to PostgreSQL, deduplicated, one transaction per batch.

    With no arguments (as ``OTEL_TRACES_EXPORTER=agentcap`` creates it) the DSN comes from
    ``AGENTCAP_DSN``, else an embedded server is started. A failed write is retried with backoff
    for up to ``retry_timeout`` seconds inside ``export``; after that the batch is reported as
    FAILURE, logged and counted (``stats().events_failed``). ``export`` never raises.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        database: Database | None = None,
        owns_database: bool | None = None,
        retry_timeout: float = 10.0,
    ) -> None:
        self._database = database if database is not None else Database(resolve_dsn(dsn))
        # By default the exporter closes the pool at shutdown only if it opened it.
        self._owns_database = database is None if owns_database is None else owns_database
        # A pool wait longer than the retry deadline would hold export past it.
        self._writer = EventWriter(
            self._database.pool, connect_timeout=max(0.5, min(10.0, retry_timeout))
        )
        self._retry_timeout = retry_timeout
        self._stats = ExportStats()
        self._stats_lock = threading.Lock()
        self._shutdown = threading.Event()

    @property
    def database(self) -> Database:
        return self._database

    def stats(self) -> ExportStats:
        with self._stats_lock:
            return ExportStats(**asdict(self._stats))

    def count_dropped(self, span: ReadableSpan) -> None:
        """Count a span the export queue in front of this exporter dropped, and its events."""
        try:
            events = len(batch_from_spans([span]).events)
        except Exception:
            events = 0
        with self._stats_lock:
            self._stats.spans_dropped += 1
            self._stats.events_dropped += events

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown.is_set():
            return SpanExportResult.FAILURE
        try:
            return self._export(spans)
        except Exception:  # a bug of ours must not reach the BatchSpanProcessor's thread
            _logger.exception("agentcap: export failed unexpectedly")
            return SpanExportResult.FAILURE

    def _export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        batch = batch_from_spans(spans, raw_payloads=True)
        if batch.unreadable or batch.rejected:
            with self._stats_lock:
                self._stats.events_unreadable += batch.unreadable
                self._stats.spans_rejected += len(batch.rejected)
            if batch.rejected:
                _log_rejected_spans(batch)
        if not batch.events and not batch.agents and not batch.spans:
            return SpanExportResult.SUCCESS
        deadline = time.monotonic() + self._retry_timeout
        delay = 0.05
        while True:
            try:
                result = write_spans(self._database, self._writer, spans, batch)
            except AgentCapStorageError as exc:
                with self._stats_lock:
                    self._stats.failed_attempts += 1
                if not exc.retryable and isinstance(exc, WriteFailed) and len(spans) > 1:
                    # One bad row rolls back the whole batch: write the halves apart, so only
                    # the spans whose rows the server refuses are lost.
                    _logger.warning(
                        "agentcap: a batch of %d spans was rejected (%s); writing it in halves",
                        len(spans),
                        exc,
                    )
                    middle = len(spans) // 2
                    first = self._export(spans[:middle])
                    second = self._export(spans[middle:])
                    return (
                        SpanExportResult.SUCCESS
                        if first is second is SpanExportResult.SUCCESS
                        else SpanExportResult.FAILURE
                    )
                if (
                    not exc.retryable
                    or time.monotonic() + delay > deadline
                    or self._shutdown.is_set()
                ):
                    with self._stats_lock:
                        self._stats.failed_batches += 1
                        self._stats.events_failed += len(batch.events) + len(batch.superseded)
                    _logger.error(
                        "agentcap: could not store %d events (%s); giving up on this batch",
                        len(batch.events) + len(batch.superseded),
                        exc,
                    )
                    return SpanExportResult.FAILURE
                _logger.warning("agentcap: write failed (%s); retrying in %.2f s", exc, delay)
                self._shutdown.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            with self._stats_lock:
                self._stats.batches += 1
                self._stats.events_inserted += result.inserted
                self._stats.duplicates += result.duplicates
                self._stats.conflicts += result.conflicts
                self._stats.events_rejected += result.rejected
                self._stats.records_rejected += result.rejected_records
                self._stats.record_conflicts += result.record_conflicts
            if result.conflicts:
                _logger.error(
                    "agentcap: %d events collided with different stored events; kept in "
                    "agentcap.conflicts",
                    result.conflicts,
                )
            return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        self._shutdown.set()
        try:
            self._writer.close()
        except Exception:
            _logger.debug("agentcap: closing the writer failed", exc_info=True)
        if self._owns_database:
            self._database.close()
