"""``Delivery``: the thread that moves records from the durable queue into PostgreSQL.

It reads chunks of records from the queue's sources in turn (this process's log, the memory
fallback, queues adopted from ended processes), decodes and maps them to rows on its own thread,
hands the rows to the exporter's writers (in parallel, split by agent) and, once every part of a
chunk is stored, acknowledges the chunk to its source, which then forgets it (segments fully
acknowledged are deleted). Storage is at-least-once: a chunk whose acknowledgement is lost is
sent again by whoever reads it next, and the log stores its events once (exact repeats are
counted as duplicates). Up to ``max_in_flight`` chunks are being written while the next is read.

A chunk is never given up while the process runs: its parts are retried with backoff while the
database is down. Records the database refuses for good (after the exporter has split their
batch down to single spans) are written to the queue directory's ``rejected/`` directory, in the
same segment format, and counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Final

from otel_agentcap.exporters.postgres.exporter import Part, PartOutcome, PostgresSpanExporter
from otel_agentcap.exporters.postgres.pacing import PAUSE_EVERY

from .frames import SEGMENT_HEADER, encode_frame
from .queue import AdoptedSource, Chunk, DiskQueue, MemorySource, OwnSource, Source
from .records import UnknownRecord, decode_span, encode_span
from .segments import UnknownFormat

_logger = logging.getLogger(__name__)

DEFAULT_BATCH_SPANS: Final = 2048
DEFAULT_BATCH_BYTES: Final = 8 * 1024 * 1024
#: A chunk in flight for longer than this means delivery is stalled: ended spans are no longer
#: kept in memory for it (see ``OwnSource.keep_memos``).
STALL_S: Final = 2.0
DEFAULT_SCHEDULE_DELAY: Final = 0.5
DEFAULT_ADOPT_INTERVAL: Final = 10.0


@dataclass
class _InFlight:
    chunk: Chunk
    parts: list[Part]
    futures: list[Future[PartOutcome]]
    undecodable: list[bytes] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


@dataclass
class DeliveryCounters:
    spans_adopted: int = 0
    spans_refused: int = 0
    bytes_corrupt: int = 0
    own_acked: int = 0
    spans_left: int = 0


class Delivery:
    """Delivers ``queue`` through ``exporter`` on a thread of its own (see the module doc)."""

    def __init__(
        self,
        queue: DiskQueue,
        exporter: PostgresSpanExporter,
        *,
        batch_spans: int = DEFAULT_BATCH_SPANS,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        schedule_delay: float = DEFAULT_SCHEDULE_DELAY,
        adopt_interval: float = DEFAULT_ADOPT_INTERVAL,
        max_in_flight: int = 2,
        adopt: bool = True,
    ) -> None:
        if batch_spans < 1 or batch_bytes < 1:
            raise ValueError("batch sizes must be positive")
        self._queue = queue
        self._exporter = exporter
        self.batch_spans = batch_spans
        self.batch_bytes = batch_bytes
        self.schedule_delay = schedule_delay
        self.adopt_interval = adopt_interval
        self.max_in_flight = max(1, max_in_flight)
        self._adopt_enabled = adopt
        self.counters = DeliveryCounters()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._progress = threading.Condition()
        self._urgent = 0
        self._scanned = threading.Event()  # the first look for queues to adopt is done
        self._scans = 0  # looks for queues to adopt done so far
        self._scan_asked = False
        self._in_flight: deque[_InFlight] = deque()
        self._adopted: list[AdoptedSource] = []
        self._skip: set[str] = set()
        self._next_source = 0
        self._own_handed = 0
        self._lock = threading.Lock()
        queue.on_append = self._appended
        self._thread = threading.Thread(target=self._run, name="agentcap-delivery", daemon=True)
        self._thread.start()

    # --- hooks -------------------------------------------------------------------------------

    def _appended(self) -> None:
        own = self._queue.own
        if own is not None and own.log.records - self._own_handed >= self.batch_spans:
            self._wake.set()

    @property
    def adopted(self) -> list[AdoptedSource]:
        return list(self._adopted)

    def waiting_spans(self) -> int:
        """Spans handed to this process's queue and not yet stored (own log and memory), plus
        those of adopted queues read and not yet stored."""
        queue = self._queue
        own = queue.own.log.records if queue.own is not None else 0
        memory = queue.memory.put_count - queue.memory.acked
        adopted = sum(s.read_records - s.acked_records for s in self._adopted)
        return own - self.counters.own_acked + memory + adopted

    # --- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        next_adopt = 0.0
        last_was_full = True
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if self._adopt_enabled and (now >= next_adopt or self._scan_asked):
                    self._scan_asked = False
                    self._finish_adopted()
                    self._adopt()
                    with self._progress:
                        self._scans += 1
                        self._progress.notify_all()
                    self._scanned.set()
                    next_adopt = now + self.adopt_interval
                self._settle(block=False)
                if self._queue.own is not None:
                    self._queue.own.keep_memos(not self._stalled(now))
                if len(self._in_flight) >= self.max_in_flight:
                    self._settle(block=True)
                    continue
                if not last_was_full and not self._urgent:
                    # A small batch went out: let the next one fill up a little first.
                    self._wake.wait(self.schedule_delay)
                    self._wake.clear()
                started = self._start_batch()
                if started is not None:
                    last_was_full = started
                    continue
                last_was_full = True
                if self._in_flight:
                    self._settle(block=True)
                    continue
                self._finish_adopted()
                with self._progress:
                    self._progress.notify_all()
                self._wake.wait(self.schedule_delay)
                self._wake.clear()
            except Exception:
                _logger.exception("agentcap: the delivery thread failed; it continues")
                self._stop.wait(1.0)

    def _stalled(self, now: float) -> bool:
        """Whether the oldest chunk in flight has waited longer than ``STALL_S`` (the
        database is down, hung or very slow)."""
        return bool(self._in_flight) and now - self._in_flight[0].started > STALL_S

    def _sources(self) -> list[Source]:
        sources: list[Source] = []
        if self._queue.own is not None:
            sources.append(self._queue.own)
        sources.append(self._queue.memory)
        sources.extend(s for s in self._adopted if not s.removed)
        return sources

    def _start_batch(self) -> bool | None:
        """Read, map and submit one chunk; whether it was full, or None when no source had
        any records."""
        sources = self._sources()
        count = len(sources)
        for step in range(count):
            source = sources[(self._next_source + step) % count]
            try:
                chunk = source.read(self.batch_spans, self.batch_bytes)
            except (OSError, UnknownFormat) as exc:
                self._drop_source(source, exc)
                continue
            if chunk is None:
                continue
            self._next_source = (self._next_source + step + 1) % count
            if isinstance(source, OwnSource):
                self._own_handed += len(chunk.records)
            elif isinstance(source, AdoptedSource):
                self.counters.spans_adopted += len(chunk.records)
            spans: list[Any] = []
            records: list[Any] = []
            undecodable: list[bytes] = []
            pause = self._exporter.pause_for_writers
            countdown = PAUSE_EVERY
            for record in chunk.records:
                if type(record) is bytes:  # a span kept in memory costs nothing here
                    countdown -= 1
                    if not countdown:
                        countdown = PAUSE_EVERY
                        pause()
                    try:
                        spans.append(decode_span(record))
                    except UnknownRecord:
                        undecodable.append(record)
                        continue
                else:
                    spans.append(record)  # the ended span itself, kept in memory for it
                records.append(record)
            parts = self._exporter.prepare_parts(spans, records, direct=source.fresh)
            futures = self._exporter.submit(parts, direct=source.fresh, stop=self._abandon)
            self._in_flight.append(_InFlight(chunk, parts, futures, undecodable))
            return len(chunk.records) >= self.batch_spans or (
                sum(len(r) for r in chunk.records if type(r) is bytes) >= self.batch_bytes
            )
        return None

    def _settle(self, *, block: bool) -> None:
        """Account for the oldest chunks whose parts are all done (waiting up to 0.2 s for
        the oldest one when ``block``), acknowledging each to its source in order."""
        while self._in_flight:
            head = self._in_flight[0]
            if not all(f.done() for f in head.futures):
                if not block or self._stop.is_set():
                    return
                wait_futures(head.futures, timeout=0.2)
                block = False
                continue
            self._in_flight.popleft()
            outcomes: list[PartOutcome] = []
            for part, future in zip(head.parts, head.futures, strict=True):
                try:
                    outcomes.append(future.result())
                except Exception as exc:
                    # A bug of ours: keep the part's records as rejected rather than loop on them.
                    _logger.error(
                        "agentcap: storing %d spans failed unexpectedly: %r", len(part.spans), exc
                    )
                    outcomes.append(
                        PartOutcome(
                            True,
                            failed_events=part.events,
                            rejected_records=list(part.records or ()),
                            rejected_reason=f"unexpected error {exc!r}",
                        )
                    )
            self._exporter.settle(head.parts, outcomes)
            if not all(o.done for o in outcomes):
                # Given up at shutdown: this chunk and every later one stay unacknowledged.
                self._in_flight.appendleft(head)
                return
            rejected = [
                r if type(r) is bytes else encode_span(r)
                for o in outcomes
                for r in o.rejected_records
            ] + head.undecodable
            if rejected:
                reason = next((o.rejected_reason for o in outcomes if o.rejected_reason), "")
                self._keep_rejected(rejected, reason or "records this version cannot read")
            source = head.chunk.source
            source.ack(head.chunk)
            if isinstance(source, OwnSource):
                self.counters.own_acked += len(head.chunk.records)
                self._queue.room_made()
            elif isinstance(source, AdoptedSource):
                self._queue.adopted_bytes = sum(s.waiting_bytes() for s in self._adopted)
                self._queue.room_made()
            with self._progress:
                self._progress.notify_all()
            block = False

    # --- adopted queues ----------------------------------------------------------------------

    def _adopt(self) -> None:
        with contextlib.suppress(OSError):
            self._queue.directory.cleanup_temporary()
        try:
            found = self._queue.adopt(self._skip | {s.name for s in self._adopted})
        except OSError:
            return
        for source in found:
            self._adopted.append(source)
            _logger.info(
                "agentcap: delivering the queue %s that an ended process left in %s",
                source.name,
                self._queue.directory.path,
            )
        if found:
            self._queue.adopted_bytes = sum(s.waiting_bytes() for s in self._adopted)

    def _finish_adopted(self) -> None:
        busy = {id(f.chunk.source) for f in self._in_flight}
        for source in list(self._adopted):
            if source.removed or id(source) in busy or not source.exhausted():
                continue
            self._report_damage(source)
            try:
                source.finish()
            except OSError as exc:
                _logger.warning(
                    "agentcap: could not remove the delivered queue %s: %s", source.name, exc
                )
                source.release()
                source.removed = True
            self._adopted.remove(source)
            _logger.info(
                "agentcap: delivered %d spans that an ended process left (queue %s)",
                source.acked_records,
                source.name,
            )
        self._queue.adopted_bytes = sum(s.waiting_bytes() for s in self._adopted)

    def _report_damage(self, source: AdoptedSource) -> None:
        skipped, torn = source.scan
        self.counters.bytes_corrupt += skipped + torn
        if torn:
            _logger.warning(
                "agentcap: queue %s ended in %d bytes of a cut record (its process died while "
                "writing it); every complete record was delivered",
                source.name,
                torn,
            )
        if skipped:
            _logger.error(
                "agentcap: queue %s held %d bytes of damaged records before its end (a power "
                "loss before they reached the disk, a disk error, or another program writing "
                "there); the spans in them are lost, every intact record was delivered",
                source.name,
                skipped,
            )

    def _drop_source(self, source: Source, exc: Exception) -> None:
        if isinstance(source, AdoptedSource):
            self._skip.add(source.name)
            self._adopted.remove(source)
            source.release()
            _logger.warning(
                "agentcap: cannot read the queue %s (%s); left in place for a version that can",
                source.name,
                exc,
            )
        else:
            self._queue.faults.fault("disk queue", f"cannot read {source.name}: {exc}")

    def _keep_rejected(self, records: list[bytes], reason: str) -> None:
        self.counters.spans_refused += len(records)
        directory = self._queue.directory.rejected
        path = directory / f"{os.getpid()}-{int(time.time())}.seg"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            new = not path.exists()
            with open(path, "ab") as file:
                if new:
                    file.write(SEGMENT_HEADER)
                for record in records:
                    file.write(encode_frame(record))
                file.flush()
                os.fsync(file.fileno())
        except OSError as exc:
            _logger.error(
                "agentcap: %d span(s) the database refuses (%s) could not be kept in %s: %s",
                len(records),
                reason,
                directory,
                exc,
            )
            return
        _logger.error(
            "agentcap: %d span(s) the database refuses for good (%s) are kept in %s",
            len(records),
            reason,
            path,
        )

    # --- flush and close -----------------------------------------------------------------------

    def _own_target(self) -> tuple[int, int]:
        queue = self._queue
        own = queue.own.log.records if queue.own is not None else 0
        return own, queue.memory.put_count

    def _reached(self, target: tuple[int, int]) -> bool:
        own, memory = target
        return self.counters.own_acked >= own and self._queue.memory.acked >= memory

    def flush(self, timeout: float) -> bool:
        """Wait until every span queued before the call is stored, or ``timeout`` seconds."""
        target = self._own_target()
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            self._urgent += 1
        try:
            self._wake.set()
            with self._progress:
                while not self._reached(target):
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        break
                    self._progress.wait(min(left, 0.1))
                    self._wake.set()
            return self._reached(target)
        finally:
            with self._lock:
                self._urgent -= 1

    def drain_adopted(self, deadline: float, *, look_again: bool = False) -> bool:
        """Wait until the adopted queues are delivered, or the monotonic ``deadline``. With
        ``look_again``, first look for queues of processes that ended since the last look (this
        process's forked children, say) and deliver them too."""
        if self._adopt_enabled and look_again and self._thread.is_alive():
            with self._progress:
                target = self._scans + 1
                self._scan_asked = True
                self._wake.set()
                while self._scans < target and time.monotonic() < deadline:
                    self._progress.wait(min(0.1, max(0.0, deadline - time.monotonic())))
        if self._adopt_enabled:
            self._scanned.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._urgent += 1
        try:
            with self._progress:
                while self._adopted:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._wake.set()
                    self._progress.wait(min(left, 0.1))
            return True
        finally:
            with self._lock:
                self._urgent -= 1

    def stop(self, timeout: float) -> list[bytes]:
        """Stop delivering: writers give up their retries, the thread ends (waits up to
        ``timeout`` seconds). Returns the memory records not stored, for the caller to keep."""
        self._abandon.set()
        self._stop.set()
        self._wake.set()
        self._thread.join(max(0.05, timeout))
        unstored: list[bytes] = []
        for flight in self._in_flight:
            if isinstance(flight.chunk.source, MemorySource):
                unstored.extend(flight.chunk.records)
        unstored.extend(self._queue.memory.drain())
        for source in self._adopted:
            source.release()
        return unstored

    def leftovers(self) -> tuple[int, int]:
        """(own spans not stored, adopted spans read and not stored) right now."""
        queue = self._queue
        own = (queue.own.log.records if queue.own is not None else 0) - self.counters.own_acked
        adopted = sum(s.read_records - s.acked_records for s in self._adopted)
        return own, adopted
