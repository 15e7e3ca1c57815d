"""The own queue's source: records come back once each and in order, whether delivery takes them
from memory (the spans their writer left) or reads them from disk, and positions agree; threads
that put at once keep to the queue's bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.exporters.durable.directory import QueueDirectory
from otel_agentcap.exporters.durable.frames import encode_frame
from otel_agentcap.exporters.durable.queue import OwnSource
from otel_agentcap.exporters.durable.segments import Position, SegmentLog, SegmentReader


class Memo:
    """Stands for a record in memory (as an ended span does)."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(1, 400), st.booleans()),
            st.tuples(st.just("read"), st.integers(1, 9), st.just(False)),
            # Delivery stalls (memos forgotten, none kept) or resumes.
            st.tuples(st.just("keep_memos"), st.just(0), st.booleans()),
        ),
        max_size=120,
    ),
    memo_limit=st.integers(0, 6),
)
def test_memory_and_disk_hand_out_each_record_once_in_order(tmp_path_factory, steps, memo_limit):
    """Any interleaving of appends (with or without a memo, memos bounded), reads of any size and
    stalls of delivery (memos dropped) yields every appended record exactly once, in order, each
    read ending at the position of its last record."""
    directory = QueueDirectory(tmp_path_factory.mktemp("q"), "db")
    locked = directory.create_queue()
    log = SegmentLog(locked.path, segment_bytes=1024)
    source = OwnSource(locked, log, memo_limit)
    appended: list[bytes] = []
    ends: list[Position] = []
    got: list[bytes] = []

    def read(n: int) -> None:
        chunk = source.read(n, 1 << 20)
        if chunk is None:
            return
        got.extend(r.payload if isinstance(r, Memo) else r for r in chunk.records)
        assert chunk.marker == ends[len(got) - 1]

    for i, (op, n, with_memo) in enumerate(steps):
        if op == "append":
            payload = f"{i}:".encode() + b"z" * n
            appended.append(payload)
            ends.append(log.append(encode_frame(payload), Memo(payload) if with_memo else None))
        elif op == "keep_memos":
            source.keep_memos(with_memo)
            if not with_memo:
                assert not log.memos
        else:
            read(n)
    while len(got) < len(appended):
        before = len(got)
        read(7)
        assert len(got) > before
    assert got == appended
    assert source.read(5, 1 << 20) is None
    log.close()
    # What is on disk is the same records.
    reader = SegmentReader(locked.path, Position(0, 0))
    on_disk: list[bytes] = []
    while batch := reader.read(100, 1 << 20):
        on_disk.extend(batch)
    assert on_disk == appended


def test_a_stalled_delivery_keeps_no_spans_in_memory(tmp_path):
    """While delivery is stalled, writers leave no memos (the backlog is on disk only); once it
    resumes they do again, up to the limit."""
    locked = QueueDirectory(tmp_path, "db").create_queue()
    log = SegmentLog(locked.path)
    source = OwnSource(locked, log, 3)
    log.append(encode_frame(b"a"), Memo(b"a"))
    source.keep_memos(False)
    assert not log.memos
    log.append(encode_frame(b"b"), Memo(b"b"))
    assert not log.memos
    source.keep_memos(True)
    for payload in (b"c", b"d", b"e", b"f"):
        log.append(encode_frame(payload), Memo(payload))
    assert len(log.memos) == 3
    chunk = source.read(10, 1 << 20)
    assert chunk is not None and chunk.records == [b"a", b"b", b"c", b"d", b"e", b"f"]
    log.close()


@pytest.mark.parametrize("overflow", ["drop", "block"])
def test_threads_that_put_at_once_never_take_the_queue_past_its_bound(tmp_path, overflow):
    """Sixteen threads putting at once into a queue nobody delivers never take it past
    max_bytes, under either policy, and every span is placed on disk or dropped and counted."""
    import logging
    import threading

    from otel_agentcap.exporters.durable.queue import DiskQueue
    from otel_agentcap.exporters.faults import FaultLog

    queue = DiskQueue(
        QueueDirectory(tmp_path, "db"),
        faults=FaultLog(logging.getLogger("test")),
        max_bytes=1024 * 1024,
        overflow=overflow,
        block_timeout=0.05,
    )
    placed: list[object] = []
    start = threading.Barrier(16)

    def put() -> None:
        start.wait()
        for _ in range(200):
            placed.append(queue.put(b"x" * 8000))

    threads = [threading.Thread(target=put) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert queue.waiting_bytes() <= queue.max_bytes
        assert placed.count("disk") + placed.count(None) == 16 * 200
        assert queue.counters.spans_dropped == placed.count(None)
    finally:
        queue.close(remove_if_empty=False)


def test_a_queue_directory_still_unusable_when_retried_keeps_spans_in_memory(
    tmp_path, monkeypatch
):
    """A queue directory that cannot be created, tried again when a span is put after the retry
    delay and still failing: the span is kept in memory and the failure counted (the retry once
    waited forever on a lock its own thread held)."""
    import threading

    from otel_agentcap.exporters.durable import queue as queue_module
    from otel_agentcap.exporters.faults import FaultLog

    monkeypatch.setattr(queue_module, "_DISK_RETRY_S", 0.0)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    queue = queue_module.DiskQueue(QueueDirectory(blocker / "queue", "db"), faults=FaultLog())
    placed: list[object] = []
    putter = threading.Thread(target=lambda: placed.append(queue.put(b"x" * 100)), daemon=True)
    putter.start()
    putter.join(60)  # a hang, not a duration: the put takes milliseconds
    try:
        assert not putter.is_alive(), "put() hung retrying the queue directory"
        assert placed == ["memory"]
        assert queue.counters.disk_errors == 2
    finally:
        if not putter.is_alive():
            queue.close(remove_if_empty=False)
