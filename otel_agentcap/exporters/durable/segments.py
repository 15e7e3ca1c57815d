"""One process's queue on disk: append-only segment files, their reader, and the acked position.

* :class:`SegmentLog` appends frames (``frames.encode_frame``) to the active segment with one
  ``write()`` each, which puts them in the kernel's page cache: from the moment ``append`` returns,
  a crash of the process (``SIGKILL`` included) cannot lose them; only a crash of the machine can
  lose what :meth:`SegmentLog.sync` has not yet flushed to the disk (``fdatasync``). A segment is
  sealed, and the next one started, when it would grow past its size limit.
* :class:`SegmentReader` reads the complete records of a queue in order from a position on: of
  the live queue of this process up to what has been appended, of a queue whose process ended up
  to the end of its files (keeping every complete record, see ``frames.scan``).
* :class:`AckFile` holds the position up to which every record is stored in the database. It is
  written after each stored batch and never flushed on purpose: a lost or stale acked position
  only makes a later reader send records again, which the log stores once.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, NamedTuple

from .frames import SEGMENT_HEADER, ScanResult, check_header, scan

SEGMENT_SUFFIX: Final = ".seg"
ACK_FILE: Final = "acked"
HEADER_SIZE: Final = len(SEGMENT_HEADER)
FORMAT_VERSION: Final = SEGMENT_HEADER[-1]
DEFAULT_SEGMENT_BYTES: Final = 16 * 1024 * 1024
_READ_CHUNK: Final = 4 * 1024 * 1024
_fdatasync = getattr(os, "fdatasync", os.fsync)


class UnknownFormat(Exception):
    """A segment written in a format this version does not read (a newer one)."""


class Position(NamedTuple):
    """A place in a queue: segment index and byte offset in it (the next byte to read)."""

    segment: int
    offset: int


def segment_path(directory: Path, index: int) -> Path:
    return directory / f"{index:012d}{SEGMENT_SUFFIX}"


def segment_indexes(directory: Path) -> list[int]:
    """The indexes of the segment files in ``directory``, ascending."""
    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        stem, _, suffix = name.partition(".")
        if "." + suffix == SEGMENT_SUFFIX and stem.isdigit():
            found.append(int(stem))
    return sorted(found)


class AckFile:
    """The acked position of a queue, one line of text: ``<segment> <offset>``."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / ACK_FILE

    def load(self) -> Position:
        """The stored position; the start of the queue when there is none or it is unreadable."""
        try:
            text = self.path.read_text("ascii")
            segment, offset = (int(part) for part in text.split())
        except (OSError, ValueError, UnicodeDecodeError):
            return Position(0, 0)
        return Position(segment, offset) if segment >= 0 and offset >= 0 else Position(0, 0)

    def store(self, position: Position) -> None:
        """Write ``position`` in place (one ``pwrite`` of fixed width); raises OSError."""
        line = f"{position.segment:012d} {position.offset:015d}\n".encode("ascii")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, line, 0)
        finally:
            os.close(fd)


@dataclass(eq=False)
class _Segment:
    index: int
    path: Path
    fd: int
    size: int
    synced: int = 0
    sealed: bool = False


@dataclass
class _Sync:
    """What a sync pass flushes: segments and the sizes they had when it started."""

    segments: list[tuple[_Segment, int]] = field(default_factory=list)
    directory: bool = False


class SegmentLog:
    """The append side of this process's queue (thread-safe).

    ``append`` raises ``OSError`` when the disk refuses the write (full, read-only, gone); the
    segment is then cut back to its last complete record, so nothing half-written stays in it.
    """

    def __init__(self, directory: Path, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        if segment_bytes < HEADER_SIZE + 64:
            raise ValueError("segment_bytes is too small")
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._bytes = 0
        #: Records appended in all.
        self.records = 0
        #: ``(ordinal, end position, memo)`` of recent records (see :meth:`append`).
        self.memos: collections.deque[tuple[int, Position, object]] = collections.deque()
        self.memo_limit = 0
        self._dir_dirty = False
        self._closed = False
        existing = segment_indexes(directory)
        self._active = self._open_segment(existing[-1] + 1 if existing else 0)

    @property
    def size(self) -> int:
        """Bytes in this queue's segment files (acked records included until their segment goes)."""
        return self._bytes

    @property
    def active_index(self) -> int:
        return self._active.index

    def _open_segment(self, index: int) -> _Segment:
        path = segment_path(self.directory, index)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        segment = _Segment(index, path, fd, 0)
        try:
            self._write(segment, SEGMENT_HEADER)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        self._segments[index] = segment
        self._bytes += segment.size
        self._dir_dirty = True
        return segment

    def _write(self, segment: _Segment, data: bytes) -> None:
        view = memoryview(data)
        written = 0
        try:
            while written < len(data):
                n = os.write(segment.fd, view[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += n
        except OSError:
            if segment.fd >= 0:  # cut back whatever part of the frame reached the file
                try:
                    os.ftruncate(segment.fd, segment.size)
                except OSError:
                    # The torn bytes stay: seal the segment at its real length, so readers
                    # skip them (frames.scan) and the next append starts a new segment.
                    with contextlib.suppress(OSError):
                        real = os.fstat(segment.fd).st_size
                        self._bytes += real - segment.size
                        segment.size = real
                    segment.sealed = True
            raise
        segment.size += written

    def append(self, frame: bytes, memo: object = None) -> Position:
        """Append one frame; returns the position just after it. Raises OSError.

        ``memo`` (anything that stands for the record, e.g. the span it was made from) is kept
        in :attr:`memos` with the record's ordinal (1 for the first record) and end position,
        while fewer than ``memo_limit`` are kept, so that a reader in this process can take the
        record from memory instead of reading and decoding it (see ``queue.OwnSource``)."""
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "the queue is closed")
            segment = self._active
            if segment.sealed or (
                segment.size > HEADER_SIZE and segment.size + len(frame) > self.segment_bytes
            ):
                segment.sealed = True
                segment = self._active = self._open_segment(segment.index + 1)
            self._write(segment, frame)
            self._bytes += len(frame)
            self.records += 1
            end = Position(segment.index, segment.size)
            if memo is not None and len(self.memos) < self.memo_limit:
                self.memos.append((self.records, end, memo))
            return end

    def set_memo_limit(self, limit: int) -> None:
        """Keep at most ``limit`` memos from now on; with 0, forget those kept (the records
        are on disk: a reader reads them from there)."""
        with self._lock:
            self.memo_limit = limit
            if limit == 0:
                self.memos.clear()

    def rotate_if_drained(self, position: Position, min_size: int) -> bool:
        """Seal the active segment and start the next one when everything in it is read up to
        ``position`` and it holds at least ``min_size`` bytes (so acknowledged records do not
        stay on disk until the segment fills). Whether it did."""
        with self._lock:
            active = self._active
            if (
                self._closed
                or active.sealed
                or position.segment != active.index
                or position.offset < active.size
                or active.size < min_size
            ):
                return False
            try:
                following = self._open_segment(active.index + 1)
            except OSError:
                return False
            active.sealed = True
            self._active = following
            return True

    def limit(self, index: int) -> tuple[int, bool] | None:
        """``(size, sealed)`` of segment ``index``, or None when this log does not hold it
        (read together under the lock: a sealed segment's size is final)."""
        with self._lock:
            segment = self._segments.get(index)
            if segment is None:
                return None
            return segment.size, segment.sealed

    def end(self) -> Position:
        """The position after the last appended record."""
        with self._lock:
            return Position(self._active.index, self._active.size)

    def sync(self, upto: Position | None = None) -> None:
        """Flush appended records to the disk (``fdatasync``), at least up to ``upto`` when given
        (a caller that finds another thread flushed past it returns at once), and the directory
        entries of new segments. Raises OSError."""
        with self._sync_lock:
            if upto is not None:
                segment = self._segments.get(upto.segment)
                if segment is None or segment.synced >= upto.offset:
                    return
            work = _Sync()
            with self._lock:
                for segment in self._segments.values():
                    # Unflushed data, or a sealed segment whose descriptor can now be closed.
                    if segment.fd >= 0 and (
                        segment.size > segment.synced
                        or (segment.sealed and segment is not self._active)
                    ):
                        work.segments.append((segment, segment.size))
                work.directory, self._dir_dirty = self._dir_dirty, False
            for segment, size in work.segments:
                if size > segment.synced:
                    _fdatasync(segment.fd)
                    segment.synced = size
                if segment.sealed and segment is not self._active and segment.synced >= size:
                    with self._lock:
                        fd, segment.fd = segment.fd, -1
                    os.close(fd)
            if work.directory:
                try:
                    dir_fd = os.open(self.directory, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    with self._lock:
                        self._dir_dirty = True
                    raise
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)

    def unsynced(self) -> int:
        """Bytes appended but not yet flushed to the disk."""
        with self._lock:
            return sum(s.size - s.synced for s in self._segments.values() if s.fd >= 0)

    def discard(self, index: int) -> None:
        """Delete sealed segment ``index`` (every record in it is stored)."""
        with self._sync_lock, self._lock:
            segment = self._segments.get(index)
            if segment is None or segment is self._active:
                return
            del self._segments[index]
            self._bytes -= segment.size
            if segment.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(segment.fd)
                segment.fd = -1
        with contextlib.suppress(FileNotFoundError):
            segment.path.unlink()

    def forget(self) -> None:
        """In a forked child: close every segment's descriptor, writing, flushing and locking
        nothing (the parent's threads, which may have held the locks, do not run here)."""
        self._closed = True
        for segment in list(self._segments.values()):
            if segment.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(segment.fd)
                segment.fd = -1

    def close(self, *, sync: bool = True) -> None:
        """Flush (unless ``sync`` is false) and close every segment."""
        if sync:
            with contextlib.suppress(OSError):
                self.sync()
        with self._sync_lock, self._lock:
            self._closed = True
            for segment in self._segments.values():
                if segment.fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(segment.fd)
                    segment.fd = -1


class SegmentReader:
    """Reads the complete records of one queue directory in order, from a position on.

    With ``log`` (this process's own, live queue) it reads up to what ``log`` has appended;
    without (a queue whose process has ended) up to the end of each file, keeping every complete
    record and counting what it had to skip (:attr:`scan`).
    """

    def __init__(self, directory: Path, start: Position, log: SegmentLog | None = None) -> None:
        self.directory = directory
        self.position = start
        self._log = log
        self._fd = -1
        self._fd_index = -1
        self.scan = ScanResult()
        self._indexes: list[int] = [] if log is not None else segment_indexes(directory)
        if log is None:
            later = [i for i in self._indexes if i >= start.segment]
            first = later[0] if later else start.segment
            if first != start.segment:
                self.position = Position(first, 0)

    def _limit(self, index: int) -> tuple[int, bool] | None:
        if self._log is not None:
            return self._log.limit(index)
        if index not in self._indexes:
            return None
        try:
            return os.stat(segment_path(self.directory, index)).st_size, True
        except FileNotFoundError:
            return None

    def _next_index(self, index: int) -> int | None:
        if self._log is not None:
            return index + 1 if self._log.limit(index + 1) is not None else None
        later = [i for i in self._indexes if i > index]
        return later[0] if later else None

    def _open(self, index: int) -> int:
        if self._fd_index != index:
            self.close()
            self._fd = os.open(segment_path(self.directory, index), os.O_RDONLY | os.O_CLOEXEC)
            self._fd_index = index
        return self._fd

    def exhausted(self) -> bool:
        """Whether everything is read (of a live queue: everything appended so far)."""
        position = self.position
        limit = self._limit(position.segment)
        if limit is None:
            return self._next_index(position.segment) is None
        size, sealed = limit
        return position.offset >= size and (
            not sealed or self._next_index(position.segment) is None
        )

    def read(self, max_records: int, max_bytes: int) -> list[bytes]:
        """Up to ``max_records`` records (stopping after about ``max_bytes``); advances
        :attr:`position` past them. Raises OSError, or UnknownFormat for a newer segment."""
        out: list[bytes] = []
        taken = 0
        while len(out) < max_records and taken < max_bytes:
            index, offset = self.position
            limit = self._limit(index)
            if limit is None:
                following = self._next_index(index)
                if following is None:
                    break
                self.position = Position(following, 0)
                continue
            size, sealed = limit
            if offset < HEADER_SIZE:
                if size < HEADER_SIZE and not sealed:
                    break
                fd = self._open(index)
                head = os.pread(fd, HEADER_SIZE, 0)
                version = check_header(head)
                if version is None:
                    # Not a segment (cut before its header was written): nothing in it.
                    self.scan.torn += size
                    offset = size
                elif version > FORMAT_VERSION:
                    raise UnknownFormat(
                        f"{segment_path(self.directory, index)} is in format {version}; "
                        f"this version reads format {FORMAT_VERSION}"
                    )
                else:
                    offset = HEADER_SIZE
                self.position = Position(index, offset)
            if offset < size:
                fd = self._open(index)
                want = min(size - offset, _READ_CHUNK)
                data = os.pread(fd, want, offset)
                at_eof = offset + len(data) >= size
                result = ScanResult()
                for record in scan(data, 0, result, at_eof=at_eof):
                    out.append(record.payload)
                    taken += len(record.payload)
                    if len(out) >= max_records or taken >= max_bytes:
                        break
                else:
                    self.scan.torn += result.torn
                    if at_eof:
                        result.end = len(data)
                self.scan.skipped += result.skipped
                if result.end == 0 and not at_eof:
                    # A record larger than the chunk: read it whole next time.
                    data = os.pread(fd, size - offset, offset)
                    result = ScanResult()
                    records = list(scan(data, 0, result, at_eof=True))
                    out.extend(r.payload for r in records)
                    taken += sum(len(r.payload) for r in records)
                    self.scan.skipped += result.skipped
                    self.scan.torn += result.torn
                    result.end = len(data)
                self.position = Position(index, offset + result.end)
                continue
            if not sealed:
                break
            following = self._next_index(index)
            if following is None:
                break
            self.position = Position(following, 0)
        return out

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1
        self._fd_index = -1
