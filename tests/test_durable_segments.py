"""Segment files of the durable queue: appended records read back in order, across segments,
while appending and after a crash; the acked position; a failed write leaves no torn record."""

from __future__ import annotations

import errno
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.exporters.durable import segments as seg
from otel_agentcap.exporters.durable.frames import SEGMENT_HEADER, encode_frame
from otel_agentcap.exporters.durable.segments import (
    AckFile,
    Position,
    SegmentLog,
    SegmentReader,
    UnknownFormat,
    segment_indexes,
    segment_path,
)


def _records(n: int, size: int = 100) -> list[bytes]:
    return [f"{i:08d}".encode() + b"x" * size for i in range(n)]


def _read_all(reader: SegmentReader, batch: int = 7) -> list[bytes]:
    out = []
    while True:
        got = reader.read(batch, 1 << 20)
        if not got:
            return out
        out.extend(got)


def test_records_read_back_in_order_across_segments(tmp_path):
    """Appends that span several segments read back complete and in order; the log reports
    its size and count."""
    log = SegmentLog(tmp_path, segment_bytes=1024)
    records = _records(100)
    for record in records:
        log.append(encode_frame(record))
    assert len(segment_indexes(tmp_path)) > 5
    assert log.records == 100
    assert log.size == sum(p.stat().st_size for p in tmp_path.glob("*.seg"))
    assert _read_all(SegmentReader(tmp_path, Position(0, 0), log)) == records
    log.close()
    # The same files, read as a queue whose process has ended.
    assert _read_all(SegmentReader(tmp_path, Position(0, 0))) == records


def test_reading_while_another_thread_appends_sees_every_record_once(tmp_path):
    """A reader racing with appending threads (and segment rotation) never sees a record twice,
    never skips one, and never sees part of one."""
    log = SegmentLog(tmp_path, segment_bytes=4096)
    reader = SegmentReader(tmp_path, Position(0, 0), log)
    writers = 4
    per_writer = 500
    seen: list[bytes] = []
    done = threading.Event()

    def write(w: int) -> None:
        for i in range(per_writer):
            log.append(encode_frame(f"{w}:{i}:".encode() + b"y" * (i % 50)))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()

    def read() -> None:
        while not done.is_set() or not reader.exhausted():
            seen.extend(reader.read(13, 1 << 20))

    reading = threading.Thread(target=read)
    reading.start()
    for t in threads:
        t.join()
    done.set()
    reading.join(30)
    assert len(seen) == writers * per_writer
    assert len(set(seen)) == len(seen)
    for w in range(writers):
        mine = [int(r.split(b":")[1]) for r in seen if r.startswith(f"{w}:".encode())]
        assert mine == list(range(per_writer))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.data())
def test_a_crash_cut_at_any_offset_keeps_every_complete_record(tmp_path_factory, sizes, data):
    """The last segment of an ended process cut at any offset (a torn last record) reads back as
    exactly the records wholly before the cut."""
    directory = tmp_path_factory.mktemp("q")
    log = SegmentLog(directory, segment_bytes=2048)
    records = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    ends = [log.append(encode_frame(r)) for r in records]
    log.close()
    last = max(segment_indexes(directory))
    path = segment_path(directory, last)
    cut = data.draw(st.integers(0, path.stat().st_size))
    os.truncate(path, cut)
    reader = SegmentReader(directory, Position(0, 0))
    kept = [
        r for r, end in zip(records, ends, strict=True) if end.segment < last or end.offset <= cut
    ]
    assert _read_all(reader) == kept
    assert reader.scan.skipped == 0


def test_reading_resumes_after_the_acked_position(tmp_path):
    """A later reader starts at the stored acked position; a garbled ack file means the start."""
    log = SegmentLog(tmp_path, segment_bytes=1024)
    records = _records(30)
    for record in records:
        log.append(encode_frame(record))
    reader = SegmentReader(tmp_path, Position(0, 0), log)
    first = reader.read(10, 1 << 20)
    AckFile(tmp_path).store(reader.position)
    log.close()
    assert first == records[:10]
    assert _read_all(SegmentReader(tmp_path, AckFile(tmp_path).load())) == records[10:]
    (tmp_path / seg.ACK_FILE).write_text("garbage")
    assert AckFile(tmp_path).load() == Position(0, 0)


def test_discard_and_rotation_free_the_disk(tmp_path):
    """Discarded sealed segments are deleted; a drained active segment is rotated away."""
    log = SegmentLog(tmp_path, segment_bytes=1024)
    for record in _records(40):
        log.append(encode_frame(record))
    reader = SegmentReader(tmp_path, Position(0, 0), log)
    _read_all(reader)
    assert log.rotate_if_drained(reader.position, min_size=1)
    for index in segment_indexes(tmp_path)[:-1]:
        log.discard(index)
    assert segment_indexes(tmp_path) == [log.active_index]
    assert log.size == len(SEGMENT_HEADER)
    log.close()


def test_a_newer_format_is_refused_not_misread(tmp_path):
    """A segment whose header names a later format version raises UnknownFormat."""
    path = segment_path(tmp_path, 0)
    path.write_bytes(SEGMENT_HEADER[:-1] + b"\x09" + encode_frame(b"x"))
    with pytest.raises(UnknownFormat):
        SegmentReader(tmp_path, Position(0, 0)).read(10, 1 << 20)


def test_a_failed_write_leaves_no_torn_record(tmp_path, monkeypatch):
    """A write the disk cuts short raises, and the segment is cut back to its last complete
    record, so the records after it still read back."""
    log = SegmentLog(tmp_path, segment_bytes=1 << 20)
    log.append(encode_frame(b"first"))
    real_write = os.write
    calls = {"n": 0}

    def short_then_full(fd, data):
        # What a filling disk does: a short write, then ENOSPC on the next call.
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(seg.os, "write", short_then_full)
    with pytest.raises(OSError):
        log.append(encode_frame(b"second"))
    monkeypatch.setattr(seg.os, "write", real_write)
    log.append(encode_frame(b"third"))
    log.close()
    reader = SegmentReader(tmp_path, Position(0, 0))
    assert _read_all(reader) == [b"first", b"third"]
    assert (reader.scan.skipped, reader.scan.torn) == (0, 0)


def test_sync_flushes_and_reports_nothing_unsynced(tmp_path):
    """After sync() nothing appended is left unflushed, also across a rotation."""
    log = SegmentLog(tmp_path, segment_bytes=1024)
    for record in _records(20):
        log.append(encode_frame(record))
    assert log.unsynced() > 0
    log.sync()
    assert log.unsynced() == 0
    log.close()
