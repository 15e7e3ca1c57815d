"""``DurableSpanProcessor``: the span processor that puts ended spans in the durable queue.

``on_end`` runs on the thread that ends the span: for a span that carries agentcap events (or is
a run's root span) it encodes the span's record (``records.encode_span``, a few microseconds)
and appends it to this process's queue on disk (one ``write()``), and returns. Other spans are
not queued (nothing of them goes to the event log). Everything else (flushing to the disk, mapping
to rows, writing to PostgreSQL, retrying) happens on background threads (``queue``,
``delivery``).

``force_flush(timeout)`` waits until every span queued before the call is stored;
``shutdown()`` (also run at interpreter exit by the TracerProvider) flushes for at most
``shutdown_timeout`` seconds, then stops: what is not stored by then stays on disk, is counted
(``stats().spans_left``) and reported in one log line, and the next process that uses the same
queue directory delivers it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from otel_agentcap import attributes as attr
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.exporters.postgres.exporter import DATABASE_CONDITION, PostgresSpanExporter
from otel_agentcap.forks import call_in_child_after_fork
from otel_agentcap.model import EventType
from otel_agentcap.pipeline.span_attributes import attributes_of

from .delivery import (
    DEFAULT_ADOPT_INTERVAL,
    DEFAULT_BATCH_BYTES,
    DEFAULT_BATCH_SPANS,
    DEFAULT_SCHEDULE_DELAY,
    Delivery,
)
from .directory import QueueDirectory
from .frames import encode_frame
from .queue import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MEMO_LIMIT,
    DEFAULT_MEMORY_LIMIT,
    DiskQueue,
    FsyncPolicy,
    Overflow,
)
from .records import OWN_EVENT_QUEUED, encode_span

_logger = logging.getLogger(__name__)

_EVENT_ID = attr.EVENT_ID
_EVENT_TYPE = attr.EVENT_TYPE
_OUTCOME = attr.OUTCOME
_RUN_ROOT = attr.RUN_ROOT
_AGENT_START = EventType.AGENT_START.value
#: Agent executions whose agent_start is queued and whose span has not ended, at most.
_MAX_STARTED = 100_000
DEFAULT_SHUTDOWN_TIMEOUT = 10.0
#: How long a shutdown without a timeout waits for a database that is down already.
DOWN_GRACE = 2.0


@dataclass(frozen=True)
class QueueSettings:
    """How the durable queue behaves (see ``queue`` and ``delivery`` for each)."""

    fsync: FsyncPolicy = "interval"
    fsync_interval: float = 1.0
    max_bytes: int = DEFAULT_MAX_BYTES
    segment_bytes: int | None = None
    overflow: Overflow = "block"
    block_timeout: float = 2.0
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    memo_limit: int = DEFAULT_MEMO_LIMIT
    batch_spans: int = DEFAULT_BATCH_SPANS
    batch_bytes: int = DEFAULT_BATCH_BYTES
    schedule_delay: float = DEFAULT_SCHEDULE_DELAY
    adopt_interval: float = DEFAULT_ADOPT_INTERVAL
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT


@dataclass(frozen=True)
class ShutdownReport:
    """What a shutdown left: this process's spans not stored, and those of adopted queues
    that were read and not stored (both stay on disk), and spans lost because neither the
    database nor the disk took them (kept only in memory)."""

    seconds: float
    spans_left: int
    adopted_left: int
    spans_lost: int


class DurableSpanProcessor(SpanProcessor):
    """Queues the spans that carry agentcap events on disk and delivers them to PostgreSQL
    through ``exporter`` (see the module doc). Add it after ``AgentCapSpanProcessor``."""

    def __init__(
        self,
        exporter: PostgresSpanExporter,
        directory: QueueDirectory,
        settings: QueueSettings | None = None,
        *,
        faults: FaultLog | None = None,
    ) -> None:
        self.exporter = exporter
        self.directory = directory
        self.settings = settings or QueueSettings()
        self.faults = faults if faults is not None else exporter.faults
        self._closed = False
        self._close_lock = threading.Lock()
        #: span id -> where an agent execution's start record went: 0 on disk, else the
        #: ordinal of the memory record (``MemorySource.put``).
        self._started: dict[int, int] = {}
        self._started_lock = threading.Lock()
        self.report: ShutdownReport | None = None
        self._start()
        call_in_child_after_fork(self._after_fork_in_child)

    def _start(self) -> None:
        settings = self.settings
        self.queue = DiskQueue(
            self.directory,
            faults=self.faults,
            fsync=settings.fsync,
            fsync_interval=settings.fsync_interval,
            max_bytes=settings.max_bytes,
            segment_bytes=settings.segment_bytes,
            overflow=settings.overflow,
            block_timeout=settings.block_timeout,
            memory_limit=settings.memory_limit,
            memo_limit=settings.memo_limit,
            on_drop=self._count_drop,
        )
        self.delivery = Delivery(
            self.queue,
            self.exporter,
            batch_spans=settings.batch_spans,
            batch_bytes=settings.batch_bytes,
            schedule_delay=settings.schedule_delay,
            adopt_interval=settings.adopt_interval,
            max_in_flight=2,
        )
        self.faults.waiting = self._waiting_text

    def _after_fork_in_child(self) -> None:
        """The child of a fork must not write to its parent's queue, whose lock, descriptors
        and threads belong to the parent: it starts a queue (and writers) of its own."""
        if self._closed:
            return
        # The child shares the open file descriptions of the parent's queue locks: were they
        # kept open here, a queue would stay locked while the child lives, after its parent
        # ended, and no process could adopt it. Closing them (not unlocking: the lock is the
        # parent's) leaves the locks to the parent alone.
        self.queue.forget_after_fork()
        for source in self.delivery.adopted:
            source.forget_after_fork()
        # Other threads may have held these at the fork.
        self._started_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._started = {}
        self._start()

    def _count_drop(self, events: int) -> None:
        self.exporter.count_dropped(None, events)

    def _waiting_text(self) -> str:
        try:
            waiting = self.delivery.waiting_spans()
            path = self.queue.path or self.directory.path
        except Exception:
            return ""
        return f"{waiting:,} spans waiting in {path}"

    # --- SpanProcessor ------------------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        # An agent execution may run for long: its agent_start is queued now, so a process that
        # dies while the agent runs still delivers it (see records: OWN_EVENT_QUEUED).
        try:
            attributes = attributes_of(span)
            if attributes.get(_EVENT_TYPE) != _AGENT_START or _EVENT_ID not in attributes:
                return
            payload = encode_span(span, attributes)
            # The span is still running: its record (a snapshot) stands for it, not the span.
            ordinal: list[int] = []
            placed = self.queue.put(payload, 1, payload, ordinal=ordinal)
            if placed is not None:
                with self._started_lock:
                    started = self._started
                    started[span.get_span_context().span_id] = ordinal[0] if ordinal else 0
                    if len(started) > _MAX_STARTED:
                        del started[next(iter(started))]
        except Exception:
            _logger.exception("agentcap: could not queue the start of %r", span.name)

    def on_end(self, span: ReadableSpan) -> None:
        try:
            attributes = attributes_of(span)
            if _EVENT_ID not in attributes and attributes.get(_RUN_ROOT) is not True:
                return  # nothing of it goes to the event log
            events = 1 + (_OUTCOME in attributes)
            started: int | None = None
            if self._started and attributes.get(_EVENT_TYPE) == _AGENT_START:
                context = span.context
                if context is not None:
                    with self._started_lock:
                        started = self._started.pop(context.span_id, None)
            if started is None:
                # Delivery takes the ended span from memory rather than reading it back.
                self.queue.put(encode_span(span, attributes), events, span)
                return
            # Its start record was queued: this record says so (a flagged record is taken as
            # its record, which carries the flag), and delivery leaves its own event out.
            payload = encode_span(span, attributes, flags=OWN_EVENT_QUEUED)
            if started == 0 or self.queue.memory.acked >= started:
                # On disk, or kept in memory and stored already.
                self.queue.put(payload, events - 1, payload)
            else:
                # Kept in memory and not stored yet: this record says so when it goes to memory
                # too (behind the start record, which is delivered first or kept with it at
                # shutdown); on disk it carries the event itself, as the start record dies with
                # the process and the disk record does not.
                self.queue.put(
                    payload, events - 1, payload, on_disk=(encode_span(span, attributes), span)
                )
        except Exception:
            _logger.exception("agentcap: could not queue span %r", getattr(span, "name", "?"))
            with contextlib.suppress(Exception):
                self.exporter.count_dropped(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.flush(timeout_millis / 1000)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every span queued before the call is stored (at most ``timeout`` seconds,
        default ``shutdown_timeout``); whether it was."""
        if self._closed:
            return False
        if timeout is None:
            timeout = self.settings.shutdown_timeout
        started = time.monotonic()
        if self.settings.fsync != "never":
            self.queue.sync()
        done = self.delivery.flush(timeout)
        if not done:
            own, _ = self.delivery.leftovers()
            _logger.warning(
                "agentcap: flush gave up after %.1f s; %d spans are not stored yet and wait in %s",
                time.monotonic() - started,
                own,
                self.queue.path or self.directory.path,
            )
        return done

    def drain(self, timeout: float) -> bool:
        """Wait until the queues that ended processes left in the directory (found when this
        processor started) are delivered, at most ``timeout`` seconds; whether they were."""
        return self.delivery.drain_adopted(time.monotonic() + max(0.0, timeout))

    def shutdown(self) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> ShutdownReport:
        """Flush for at most ``timeout`` seconds, then stop; the report says what is left on
        disk. Idempotent. Without a timeout: ``shutdown_timeout``, or at most
        ``DOWN_GRACE`` seconds when the database is down already (waiting longer would rarely
        help, and what is queued is safe on disk for the next process)."""
        with self._close_lock:
            if self.report is not None:
                return self.report
            self._closed = True
            if timeout is None:
                timeout = self.settings.shutdown_timeout
                if self.faults.is_active(DATABASE_CONDITION):
                    timeout = min(timeout, DOWN_GRACE)
            started = time.monotonic()
            deadline = started + max(0.0, timeout)
            self.queue.stop_accepting()
            flushed = self.delivery.flush(max(0.0, deadline - time.monotonic()))
            if flushed:
                # Queues that ended processes left since the last look (forked workers that
                # exited without flushing, say) are delivered too, within the timeout.
                self.delivery.drain_adopted(deadline, look_again=True)
            unstored = self.delivery.stop(max(0.05, deadline - time.monotonic()))
            lost = self._keep(unstored)
            own, adopted = self.delivery.leftovers()
            own += len(unstored) - lost
            self.queue.close(remove_if_empty=own == 0)
            self.exporter.shutdown(max(0.05, deadline - time.monotonic()))
            seconds = time.monotonic() - started
            self.report = ShutdownReport(seconds, own, adopted, lost)
            self.delivery.counters.spans_left = own + adopted
            if own or adopted or lost:
                _logger.warning(
                    "agentcap: shut down after %.1f s with %d spans of this process%s not yet "
                    "stored; they stay in %s and the next process using it delivers them%s",
                    seconds,
                    own,
                    f" and {adopted} of ended processes" if adopted else "",
                    self.directory.path,
                    f"; {lost} spans held only in memory are lost" if lost else "",
                )
            return self.report

    def _keep(self, records: list[bytes]) -> int:
        """Put records that were only in memory on disk; how many could not be."""
        own = self.queue.own
        if not records:
            return 0
        if own is None:
            for _ in records:
                self.exporter.count_dropped(None, 1)
            return len(records)
        for i, record in enumerate(records):
            try:
                own.log.append(encode_frame(record))
            except OSError:
                lost = len(records) - i
                for _ in range(lost):
                    self.exporter.count_dropped(None, 1)
                return lost
        return 0

    # --- figures -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The queue's figures, named as in ``ExportStats``."""
        queue = self.queue
        delivery = self.delivery
        own_records = queue.own.log.records if queue.own is not None else 0
        return {
            "spans_queued": max(0, delivery.waiting_spans()),
            "bytes_queued": queue.waiting_bytes(),
            "spans_enqueued": own_records + queue.memory.put_count,
            "spans_adopted": delivery.counters.spans_adopted,
            "spans_in_memory": queue.memory.put_count,
            "disk_errors": queue.counters.disk_errors,
            "spans_refused": delivery.counters.spans_refused,
            "bytes_corrupt": delivery.counters.bytes_corrupt,
            "spans_left": delivery.counters.spans_left,
        }
