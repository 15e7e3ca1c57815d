"""``DiskQueue``: the append side of the durable queue and the sources delivery reads from.

``put`` is called on the thread that ends a span. It appends the span's record to this process's
segment log with one ``write()`` (see ``segments``) and returns: from then on a crash of the
process loses nothing of it. Flushing to the disk (``fdatasync``) follows the fsync policy:

* ``"interval"`` (default): a background thread flushes every ``fsync_interval`` seconds (1 s),
  so a power loss or kernel crash can lose at most the spans ended in the last interval;
* ``"always"``: ``put`` flushes before it returns (concurrent callers share one flush), so not
  even a power loss loses an ended span, at the price of a disk flush per span on the ending
  thread (milliseconds on most disks);
* ``"never"``: the kernel flushes when it chooses (usually within 30 s).

The queue is bounded by ``max_bytes`` on disk. When it is full (the database has been down long
enough), the ``overflow`` policy decides: ``"block"`` waits up to ``block_timeout`` seconds for
delivery to make room, then drops the span (and for the next ``5 * block_timeout`` seconds drops
at once instead of waiting again, so a long outage cannot stall every captured operation);
``"drop"`` drops at once. Every dropped span is counted and the condition is logged once.

When the disk refuses a write (full, read-only, removed), spans are kept in memory instead, up to
``memory_limit`` of them (delivered like the others, but lost if the process dies), the failure
is logged once and counted, and the disk is tried again every few seconds.

Delivery reads :class:`Source` objects: this process's own log (:class:`OwnSource`), the memory
fallback (:class:`MemorySource`), and queues that ended processes left (:class:`AdoptedSource`).
Each hands out chunks of records in order and is acknowledged in order.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from otel_agentcap.exporters.faults import FaultLog

from .directory import LockedQueue, QueueDirectory
from .frames import encode_frame
from .segments import (
    DEFAULT_SEGMENT_BYTES,
    AckFile,
    Position,
    SegmentLog,
    SegmentReader,
    UnknownFormat,
    segment_indexes,
    segment_path,
)

_logger = logging.getLogger(__name__)

FsyncPolicy = Literal["interval", "always", "never"]
FSYNC_POLICIES: Final = ("interval", "always", "never")
Overflow = Literal["block", "drop"]
Placed = Literal["disk", "memory"] | None
OVERFLOW_POLICIES: Final = ("block", "drop")

DEFAULT_MAX_BYTES: Final = 1024 * 1024 * 1024
DEFAULT_MEMORY_LIMIT: Final = 10_000
#: Ended spans kept in memory next to their records, so delivery need not read them back.
DEFAULT_MEMO_LIMIT: Final = 8_192
DISK_CONDITION: Final = "disk queue"
FULL_CONDITION: Final = "queue full"
CLOSED_CONDITION: Final = "queue closed"
OVERSIZE_CONDITION: Final = "span too large"
_DISK_RETRY_S: Final = 5.0


@dataclass
class Chunk:
    """Records a source handed out, and what acknowledges them. An item of ``records`` is the
    record's payload, or what its writer left for it in memory (the ended span itself, see
    ``OwnSource``), which stands for the same record."""

    source: Source
    records: list[Any]
    marker: Position | int


class Source:
    """Records to deliver, handed out in order and acknowledged in order."""

    name: str = ""
    #: Records never sent before: a writer may copy them straight into the log.
    fresh: bool = True

    def read(self, max_records: int, max_bytes: int) -> Chunk | None:
        raise NotImplementedError

    def ack(self, chunk: Chunk) -> None:
        raise NotImplementedError

    def exhausted(self) -> bool:
        raise NotImplementedError

    def waiting_bytes(self) -> int:
        return 0


class OwnSource(Source):
    """This process's segment log.

    The disk is the source of truth; memory is a cache in front of it. A record whose writer
    left a memo (the ended span, see ``SegmentLog.append``) is taken from memory when it is the
    next one to read, so delivery neither reads nor decodes it; any other record (memos are
    bounded, ``memo_limit``) is read from disk. Either way records are handed out once each, in
    the order they were appended, and positions advance the same."""

    def __init__(self, locked: LockedQueue, log: SegmentLog, memo_limit: int = 0) -> None:
        self.name = locked.name
        self.locked = locked
        self.log = log
        log.memo_limit = memo_limit
        self._memo_limit = memo_limit
        self._reader = SegmentReader(locked.path, Position(0, 0), log)
        self._acks = AckFile(locked.path)
        self._read = 0  # ordinal of the last record handed out
        self.acked = Position(0, 0)
        self.fresh = True

    def read(self, max_records: int, max_bytes: int) -> Chunk | None:
        memos = self.log.memos
        while memos and memos[0][0] <= self._read:
            memos.popleft()  # read from disk already
        if memos and memos[0][0] == self._read + 1:
            out: list[Any] = []
            end = self._reader.position
            while memos and len(out) < max_records and memos[0][0] == self._read + 1:
                self._read, end, memo = memos.popleft()
                out.append(memo)
            self._reader.position = end
            return Chunk(self, out, end)
        records = self._reader.read(max_records, max_bytes)
        if not records:
            return None
        self._read += len(records)
        return Chunk(self, records, self._reader.position)

    def keep_memos(self, keep: bool) -> None:
        """Whether writers leave memos: not while delivery is stalled (the database down or
        hung), so a backlog waits on disk only, not also as ended spans in memory (and in the
        garbage collector's way); delivery reads it back from disk."""
        limit = self._memo_limit if keep else 0
        if self.log.memo_limit != limit:
            self.log.set_memo_limit(limit)

    def ack(self, chunk: Chunk) -> None:
        assert isinstance(chunk.marker, Position)
        marker = chunk.marker
        if self.log.rotate_if_drained(marker, min(self.log.segment_bytes // 4, 1024 * 1024)):
            marker = Position(marker.segment + 1, 0)
        self.acked = marker
        with contextlib.suppress(OSError):
            self._acks.store(marker)
        for index in segment_indexes(self.locked.path):
            if index >= marker.segment:
                break
            self.log.discard(index)

    def exhausted(self) -> bool:
        return self._reader.exhausted()

    def close(self) -> None:
        self._reader.close()


class MemorySource(Source):
    """Records kept in memory while the disk refuses them."""

    name = "memory"

    def __init__(self) -> None:
        self._records: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        self.bytes = 0
        #: Records put, handed out, acknowledged (in all).
        self.put_count = 0
        self.taken = 0
        self.acked = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: bytes) -> int:
        """Keep ``record``; its ordinal (the record is stored once ``acked`` reaches it)."""
        with self._lock:
            self._records.append(record)
            self.bytes += len(record)
            self.put_count += 1
            return self.put_count

    def read(self, max_records: int, max_bytes: int) -> Chunk | None:
        with self._lock:
            out: list[bytes] = []
            size = 0
            while self._records and len(out) < max_records and size < max_bytes:
                record = self._records.popleft()
                out.append(record)
                size += len(record)
            self.bytes -= size
            self.taken += len(out)
        return Chunk(self, out, self.taken) if out else None

    def ack(self, chunk: Chunk) -> None:
        assert isinstance(chunk.marker, int)
        self.acked = chunk.marker

    def exhausted(self) -> bool:
        return not self._records

    def drain(self) -> list[bytes]:
        with self._lock:
            out = list(self._records)
            self._records.clear()
            self.bytes = 0
        return out


class AdoptedSource(Source):
    """A queue an ended process left: read from its acked position to the end of its files."""

    def __init__(self, locked: LockedQueue) -> None:
        self.name = locked.name
        self.locked = locked
        self.fresh = False  # some of it may be stored already
        self._acks = AckFile(locked.path)
        self._reader = SegmentReader(locked.path, self._acks.load())
        self.read_records = 0
        self.acked_records = 0
        self.removed = False

    @property
    def scan(self) -> tuple[int, int]:
        """(skipped, torn) bytes of damaged or cut records found so far."""
        return self._reader.scan.skipped, self._reader.scan.torn

    def waiting_bytes(self) -> int:
        total = 0
        for index in segment_indexes(self.locked.path):
            if index < self._reader.position.segment:
                continue
            with contextlib.suppress(OSError):
                total += os.stat(segment_path(self.locked.path, index)).st_size
        return total

    def read(self, max_records: int, max_bytes: int) -> Chunk | None:
        records = self._reader.read(max_records, max_bytes)
        if not records:
            return None
        self.read_records += len(records)
        return Chunk(self, records, self._reader.position)

    def ack(self, chunk: Chunk) -> None:
        assert isinstance(chunk.marker, Position)
        self.acked_records += len(chunk.records)
        with contextlib.suppress(OSError):
            self._acks.store(chunk.marker)
        for index in segment_indexes(self.locked.path):
            if index >= chunk.marker.segment:
                break
            with contextlib.suppress(OSError):
                segment_path(self.locked.path, index).unlink()

    def exhausted(self) -> bool:
        return self._reader.exhausted()

    def finish(self) -> None:
        """Everything is stored: remove the queue."""
        self._reader.close()
        self.locked.remove()
        self.removed = True

    def release(self) -> None:
        """Stop reading; the queue stays for a later process."""
        self._reader.close()
        self.locked.release()

    def forget_after_fork(self) -> None:
        """In a forked child: close the descriptors shared with the parent, which goes on
        reading this queue and holds its lock."""
        self._reader.close()
        self.locked.release()


@dataclass
class QueueCounters:
    disk_errors: int = 0
    spans_dropped: int = 0
    events_dropped: int = 0


class DiskQueue:
    """This process's durable queue in ``directory`` (see the module doc)."""

    def __init__(
        self,
        directory: QueueDirectory,
        *,
        faults: FaultLog,
        fsync: FsyncPolicy = "interval",
        fsync_interval: float = 1.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        segment_bytes: int | None = None,
        overflow: Overflow = "block",
        block_timeout: float = 2.0,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        memo_limit: int = DEFAULT_MEMO_LIMIT,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, not {overflow!r}")
        if block_timeout <= 0:
            raise ValueError("block_timeout must be positive")
        if fsync_interval <= 0:
            raise ValueError("fsync_interval must be positive")
        if max_bytes < 64 * 1024:
            raise ValueError("max_bytes must be at least 64 KiB")
        self.directory = directory
        self.faults = faults
        self.fsync: FsyncPolicy = fsync
        self.fsync_interval = fsync_interval
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(
            64 * 1024, min(DEFAULT_SEGMENT_BYTES, max_bytes // 8)
        )
        self.overflow: Overflow = overflow
        self.block_timeout = block_timeout
        self.memory_limit = memory_limit
        self.memo_limit = memo_limit
        self._on_drop = on_drop
        self.counters = QueueCounters()
        self._lock = threading.Lock()
        # Held while a put opens the own log again (not _lock: a failure counts under _lock).
        self._reopen_lock = threading.Lock()
        self._room = threading.Condition(threading.Lock())
        self._reserve_lock = threading.Lock()
        self._reserved = 0  # bytes of records being placed (see put)
        self._blocking_suspended_until = 0.0
        self._disk_retry_at = 0.0
        self._accepting = True
        self.own: OwnSource | None = None
        self.memory = MemorySource()
        self.adopted_bytes = 0
        #: Called after each append with the number of records the own log holds unread, so
        #: delivery can start a batch as soon as one is full.
        self.on_append: Callable[[], None] | None = None
        self._open_own()
        self._stop_sync = threading.Event()
        self._sync_thread: threading.Thread | None = None
        if fsync == "interval":
            self._sync_thread = threading.Thread(
                target=self._sync_loop, name="agentcap-fsync", daemon=True
            )
            self._sync_thread.start()

    # --- the own log ------------------------------------------------------------------------

    def _open_own(self) -> bool:
        try:
            locked = self.directory.create_queue()
        except OSError as exc:
            self._disk_failed(exc, f"cannot create a queue in {self.directory.path}")
            return False
        try:
            log = SegmentLog(locked.path, segment_bytes=self.segment_bytes)
        except OSError as exc:
            locked.remove()
            self._disk_failed(exc, f"cannot create a segment in {locked.path}")
            return False
        self.own = OwnSource(locked, log, self.memo_limit)
        return True

    def _disk_failed(self, exc: OSError, what: str) -> None:
        with self._lock:
            self.counters.disk_errors += 1
        self._disk_retry_at = time.monotonic() + _DISK_RETRY_S
        self.faults.fault(
            DISK_CONDITION,
            f"{what}: {exc.strerror or exc}",
            consequence=(
                f"spans are kept in memory (at most {self.memory_limit:,}; not crash-safe) "
                f"until the disk takes them again"
            ),
        )

    @property
    def path(self) -> Path | None:
        return self.own.locked.path if self.own is not None else None

    # --- put --------------------------------------------------------------------------------

    def waiting_bytes(self) -> int:
        own = self.own.log.size if self.own is not None else 0
        return own + self.adopted_bytes + self.memory.bytes

    def put(
        self,
        payload: bytes,
        events: int = 1,
        memo: object = None,
        *,
        on_disk: tuple[bytes, object] | None = None,
        ordinal: list[int] | None = None,
    ) -> Placed:
        """Queue one record (see the module doc): where it went (``"disk"`` or ``"memory"``),
        or None when it was dropped (and counted). ``memo`` stands for the record in memory
        (see ``OwnSource``). ``on_disk``: another record (and its memo) to append instead when
        the record goes to the disk rather than to memory. ``ordinal``: a list the memory
        record's ordinal is appended to when the record goes to memory (see
        ``MemorySource.put``)."""
        frame = encode_frame(payload)
        disk_frame = encode_frame(on_disk[0]) if on_disk is not None else frame
        if not self._accepting:
            self._drop(events, CLOSED_CONDITION, "dropping spans that end after shutdown()")
            return None
        if len(frame) > self.max_bytes:
            # Waiting for room cannot help: drop it at once, under a condition of its own.
            self._drop(
                events,
                OVERSIZE_CONDITION,
                f"dropping a span of {len(frame):,} bytes: larger than the queue's limit of "
                f"{self.max_bytes:,} bytes (max_queue_bytes)",
            )
            return None
        size = max(len(frame), len(disk_frame))
        # Room is taken before the write and checked under one lock, so threads that put at
        # once cannot together go past the bound.
        if not self._reserve(size) and not self._wait_for_room(size):
            self._drop(
                events, FULL_CONDITION, self._full(f"the queue holds {self.max_bytes:,} bytes")
            )
            return None
        room = [size]
        if on_disk is not None:
            frame, memo = disk_frame, on_disk[1]
        try:
            return self._place(frame, payload, events, memo, room, ordinal)
        finally:
            self._release(room)

    def _reserve(self, size: int) -> bool:
        """Take ``size`` bytes of room in the bound until the record is placed; whether there
        was room."""
        with self._reserve_lock:
            if self.waiting_bytes() + self._reserved + size > self.max_bytes:
                return False
            self._reserved += size
            return True

    def _release(self, room: list[int]) -> None:
        """Give back the room ``put`` took (once): the record is counted where it went."""
        with self._reserve_lock:
            self._reserved -= room[0]
            room[0] = 0

    def _place(
        self,
        frame: bytes,
        payload: bytes,
        events: int,
        memo: object,
        room: list[int],
        ordinal: list[int] | None = None,
    ) -> Placed:
        """Append ``frame`` to the own log, else keep ``payload`` in memory (``room`` taken)."""
        own = self.own
        if own is not None and time.monotonic() >= self._disk_retry_at:
            try:
                end = own.log.append(frame, memo)
            except OSError as exc:
                self._disk_failed(exc, f"cannot write to {own.locked.path}")
            else:
                self._release(room)  # the log counts it now
                if self.faults.is_active(DISK_CONDITION):
                    self.faults.recovered(DISK_CONDITION, detail="spans go to disk again")
                if self.fsync == "always":
                    self._sync(end)
                if self.on_append is not None:
                    self.on_append()
                return "disk"
        elif own is None and time.monotonic() >= self._disk_retry_at:
            with self._reopen_lock:
                if self.own is None and time.monotonic() >= self._disk_retry_at:
                    self._open_own()
            if self.own is not None:
                return self._place(frame, payload, events, memo, room, ordinal)
        if len(self.memory) >= self.memory_limit:
            self._drop(
                events,
                FULL_CONDITION,
                self._full(f"the disk queue is unusable and memory holds {self.memory_limit:,}"),
            )
            return None
        placed_at = self.memory.put(payload)
        if ordinal is not None:
            ordinal.append(placed_at)
        self._release(room)  # the memory counts it now
        if self.on_append is not None:
            self.on_append()
        return "memory"

    def _sync(self, upto: Position | None = None) -> None:
        own = self.own
        if own is None:
            return
        try:
            own.log.sync(upto)
        except OSError as exc:
            self._disk_failed(exc, f"cannot flush {own.locked.path} to the disk")

    def _wait_for_room(self, size: int) -> bool:
        if self.overflow == "drop":
            return False
        now = time.monotonic()
        if now < self._blocking_suspended_until:
            return False
        deadline = now + self.block_timeout
        with self._room:
            while not self._reserve(size):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._blocking_suspended_until = time.monotonic() + 5 * self.block_timeout
                    return False
                self._room.wait(min(left, 0.05))
        return True

    def room_made(self) -> None:
        """Delivery freed space (a segment went): wake puts waiting for room."""
        with self._room:
            self._room.notify_all()
        if self.faults.is_active(FULL_CONDITION) and self.waiting_bytes() < self.max_bytes:
            self.faults.recovered(FULL_CONDITION)

    def _full(self, why: str) -> str:
        return f"dropping spans: {why}, its limit (policy {self.overflow!r})"

    def _drop(self, events: int, condition: str, reason: str) -> None:
        with self._lock:
            self.counters.spans_dropped += 1
            self.counters.events_dropped += events
        if self._on_drop is not None:
            with contextlib.suppress(Exception):
                self._on_drop(events)
        self.faults.fault(
            condition, reason, consequence="each dropped span and its events are counted"
        )

    # --- background flush -----------------------------------------------------------------

    def _sync_loop(self) -> None:
        while not self._stop_sync.wait(self.fsync_interval):
            self._sync()

    def sync(self) -> None:
        """Flush what is appended to the disk now (any policy)."""
        self._sync()

    def stop_accepting(self) -> None:
        self._accepting = False

    def close(self, *, remove_if_empty: bool) -> None:
        """Flush and close the own log; remove it when everything in it is stored, else release
        its lock so a later process adopts it."""
        self._stop_sync.set()
        own = self.own
        if own is None:
            return
        own.close()
        own.log.close(sync=self.fsync != "never")
        if remove_if_empty:
            own.locked.remove()
        else:
            own.locked.release()

    def forget_after_fork(self) -> None:
        """In a forked child: close the descriptors of the own log shared with the parent (its
        lock, its segments) without flushing, truncating or unlocking anything: the queue is
        the parent's. The child then opens a queue of its own. Takes no lock: one the parent's
        threads held at the fork stays held here."""
        own = self.own
        if own is None:
            return
        own.log.forget()
        own.close()
        own.locked.release()

    def adopt(self, skip: set[str]) -> list[AdoptedSource]:
        """Lock the queues ended processes left (except ``skip``) and return them as sources."""
        found = []
        own_name = self.own.name if self.own is not None else ""
        for locked in self.directory.adopt(skip | {own_name}):
            source = AdoptedSource(locked)
            found.append(source)
        return found


__all__ = [
    "AdoptedSource",
    "Chunk",
    "DiskQueue",
    "FsyncPolicy",
    "MemorySource",
    "Overflow",
    "OwnSource",
    "Source",
    "UnknownFormat",
]
