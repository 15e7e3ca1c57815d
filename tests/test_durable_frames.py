"""Framing of the durable queue: every complete record survives a torn tail or lost bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.exporters.durable.frames import (
    FRAME_MAGIC,
    FRAME_OVERHEAD,
    SEGMENT_HEADER,
    ScanResult,
    check_header,
    encode_frame,
    scan,
)

payloads = st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=30)


def _log(records: list[bytes]) -> tuple[bytes, list[int]]:
    """The frames of ``records`` back to back, and the end offset of each."""
    data = b""
    ends = []
    for record in records:
        data += encode_frame(record)
        ends.append(len(data))
    return data, ends


@given(payloads)
def test_every_record_reads_back_in_order(records):
    """Frames written back to back read back as the same payloads, in order, nothing skipped."""
    data, _ = _log(records)
    result = ScanResult()
    assert [r.payload for r in scan(data, 0, result)] == records
    assert (result.end, result.skipped, result.torn) == (len(data), 0, 0)


@settings(max_examples=300)
@given(payloads, st.data())
def test_a_torn_tail_keeps_every_complete_record(records, data):
    """Truncated at any offset, the log yields exactly the records whose frame lies wholly before
    the cut, and counts the rest as torn."""
    log, ends = _log(records)
    cut = data.draw(st.integers(0, len(log)))
    result = ScanResult()
    found = [r.payload for r in scan(log[:cut], 0, result)]
    complete = [record for record, end in zip(records, ends, strict=True) if end <= cut]
    assert found == complete
    last_end = max((end for end in ends if end <= cut), default=0)
    assert result.end == last_end
    assert result.torn == cut - last_end
    assert result.skipped == 0


@settings(max_examples=300)
@given(payloads, st.data())
def test_lost_bytes_in_the_middle_cost_only_the_records_they_touch(records, data):
    """Damaged bytes (every bit flipped) cost the records they overlap; every other complete
    record is still found, before and after them."""
    log, ends = _log(records)
    start = data.draw(st.integers(0, len(log) - 1))
    length = data.draw(st.integers(1, len(log) - start))
    flipped = bytes(b ^ 0xFF for b in log[start : start + length])
    damaged = log[:start] + flipped + log[start + length :]
    starts = [0, *ends[:-1]]
    untouched = [
        record
        for record, s, e in zip(records, starts, ends, strict=True)
        if e <= start or s >= start + length
    ]
    found = [r.payload for r in scan(damaged, 0)]
    assert found == untouched


def test_a_chunk_that_ends_inside_a_frame_stops_before_it():
    """Reading a file in chunks: a frame cut by the chunk's end is neither yielded nor torn."""
    log, ends = _log([b"a" * 10, b"b" * 10])
    result = ScanResult()
    found = [r.payload for r in scan(log[: ends[0] + 5], 0, result, at_eof=False)]
    assert found == [b"a" * 10]
    assert (result.end, result.torn, result.skipped) == (ends[0], 0, 0)


def test_the_checksum_covers_the_length():
    """A frame whose length field is changed is not read as a shorter record."""
    frame = bytearray(encode_frame(b"x" * 20))
    frame[4] = 10  # length 20 -> 10
    assert list(scan(bytes(frame), 0)) == []


def test_header_and_limits():
    """A segment header names its version; an oversized record is refused up front."""
    assert check_header(SEGMENT_HEADER) == 1
    assert check_header(b"something else..") is None
    assert len(FRAME_MAGIC) == 4 and FRAME_OVERHEAD == 12
    with pytest.raises(ValueError):
        encode_frame(b"x" * (256 * 1024 * 1024 + 1))
