"""``EventLogSpanProcessor``: a ``BatchSpanProcessor`` whose full queue follows an explicit,
observable policy instead of dropping spans with one log line.

The SDK's ``BatchSpanProcessor`` keeps at most ``max_queue_size`` ended spans (2,048 by default,
``OTEL_BSP_MAX_QUEUE_SIZE``) and, when a burst outruns the exporter, silently pushes the oldest out.
For an event log that must lose nothing, this processor applies one of two policies:

* ``"block"`` (default): the thread that ends a span waits, up to ``block_timeout`` seconds, for
  the exporter to make room. A burst against a healthy database then loses nothing; it is slowed to
  the speed of the database. If room does not come in time (the database is down or stalled), the
  span is dropped and counted, and for the next ``5 * block_timeout`` seconds further spans that
  meet a full queue are dropped at once, so an outage does not stall every captured operation.
* ``"drop"``: a span that meets a full queue is dropped and counted at once.

Every drop is counted (:attr:`EventLogSpanProcessor.dropped` spans; ``spans_dropped`` and
``events_dropped`` in ``PostgresSpanExporter.stats()`` when ``configure()`` wires ``on_drop`` to
the exporter) and logged at most every few seconds.

This is the in-memory queue (``configure(durable=False)``); by default ``configure()`` uses the
durable queue on disk instead (``exporters.durable``), which survives outages and crashes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final, Literal

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from otel_agentcap import private_parts

_logger = logging.getLogger(__name__)

Overflow = Literal["block", "drop"]
OVERFLOW_POLICIES: Final = ("block", "drop")
_LOG_EVERY_S: Final = 5.0
#: The SDK's default ``max_export_batch_size``.
_DEFAULT_BATCH_SIZE: Final = 512


class EventLogSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` with an explicit policy for a full queue (see the module doc)."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int | None = None,
        overflow: Overflow = "block",
        block_timeout: float = 2.0,
        on_drop: Callable[[ReadableSpan], None] | None = None,
        **batch_options: Any,
    ) -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, not {overflow!r}")
        if block_timeout <= 0:
            raise ValueError("block_timeout must be positive")
        if max_queue_size is not None and batch_options.get("max_export_batch_size") is None:
            # The SDK refuses a batch larger than the queue; a small queue means small batches.
            batch_options["max_export_batch_size"] = min(_DEFAULT_BATCH_SIZE, max_queue_size)
        super().__init__(exporter, max_queue_size=max_queue_size, **batch_options)
        self.overflow: Overflow = overflow
        self.block_timeout = block_timeout
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._dropped = 0
        self._blocking_suspended_until = 0.0
        self._last_log = 0.0
        self._logged_dropped = 0
        # Beware: private parts of the SDK's BatchSpanProcessor, its BatchProcessor's deque, size
        # and wake-up event: the SDK has no public way to wait for room in its queue. Present
        # since opentelemetry-sdk 1.34 (the package's floor), tested with 1.34 and 1.45. Missing:
        # one warning, and a full queue drops spans (uncounted) as the SDK's own processor does.
        # The same BatchProcessor's emit() queues a span that is not sampled too (the SDK's
        # on_end skips those); missing, such spans are not stored (one warning).
        self._queue: Any = None
        self._max_queue_size = 0
        self._wake_worker: Any = None
        self._emit: Callable[[ReadableSpan], None] | None = None
        try:
            batch = self._batch_processor
            self._queue = batch._queue  # noqa: SLF001 (see above)
            self._max_queue_size = int(batch._max_queue_size)  # noqa: SLF001 (see above)
            self._wake_worker = batch._worker_awaken  # noqa: SLF001 (see above)
            self._emit = batch.emit
        except (AttributeError, TypeError, ValueError):
            self._queue = None
        if self._emit is None:
            private_parts.missing(
                "opentelemetry-sdk",
                "BatchSpanProcessor._batch_processor.emit",
                "spans the sampler records without sampling them are not stored",
            )
        if self._queue is None or not self._max_queue_size:
            self._queue = None
            private_parts.missing(
                "opentelemetry-sdk",
                "BatchSpanProcessor._batch_processor._queue",
                "a full export queue drops spans as the SDK's processor does, uncounted",
            )

    @property
    def dropped(self) -> int:
        """Spans dropped because the queue was full."""
        with self._lock:
            return self._dropped

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        # Below half full, enqueue without the lock: the threads that saw room cannot fill the
        # other half between their check and their append (unless there are more of them than
        # that half holds). Past it, one thread at a time, so the SDK never pushes a span out.
        if queue is None or len(queue) < self._max_queue_size // 2:
            self._submit(span)
            return
        if span.context is None:
            return
        with self._lock:
            if len(queue) < self._max_queue_size or self._wait_for_room(queue):
                self._submit(span)
                return
            self._dropped += 1
            dropped = self._dropped
        if self._on_drop is not None:
            try:
                self._on_drop(span)
            except Exception:
                _logger.debug("agentcap: drop counter failed", exc_info=True)
        self._log_drops(dropped)

    def _submit(self, span: ReadableSpan) -> None:
        """Queue ``span``, sampled or not: the event log records every span (see
        ``otel_agentcap.pipeline.sampling``); the SDK's own ``on_end`` skips spans not sampled."""
        if self._emit is not None and span.context is not None:
            self._emit(span)
        else:
            super().on_end(span)

    def _wait_for_room(self, queue: Any) -> bool:
        if self.overflow == "drop":
            return False
        now = time.monotonic()
        if now < self._blocking_suspended_until:
            return False
        deadline = now + self.block_timeout
        while len(queue) >= self._max_queue_size:
            if self._wake_worker is not None:
                self._wake_worker.set()
            if time.monotonic() >= deadline:
                self._blocking_suspended_until = time.monotonic() + 5 * self.block_timeout
                return False
            time.sleep(0.001)
        return True

    def _log_drops(self, dropped: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_log < _LOG_EVERY_S:
                return
            self._last_log = now
            new = dropped - self._logged_dropped
            self._logged_dropped = dropped
        _logger.warning(
            "agentcap: export queue full (%d spans); dropped %d span(s), %d in all "
            "(policy %r, block_timeout %.1f s)",
            self._max_queue_size,
            new,
            dropped,
            self.overflow,
            self.block_timeout,
        )
