"""The on-disk format of the durable queue: segment files of framed records.

A segment file starts with a 16-byte header, ``SEGMENT_HEADER`` (the format's name and version),
followed by records, each one frame::

    magic   4 bytes   b"AQr1"
    length  4 bytes   little-endian, bytes of payload
    crc     4 bytes   little-endian CRC-32 (zlib) of the length field and the payload
    payload length bytes

A record is *complete* when its whole frame is on disk and its checksum matches. Recovery
(:func:`scan`) keeps every complete record: a frame cut short at the end of the file (a process
killed inside ``write()``, a power loss before the data reached the disk) ends the scan there, and
bytes that are not a complete frame in the middle of a file (a block the disk lost) are skipped
up to the next complete frame, found by its magic and confirmed by its checksum. Both are
counted, never fatal.

Pure functions over bytes: no I/O here.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, NamedTuple

#: The 16 bytes every segment file starts with: the format's name, NUL, its version (1).
SEGMENT_HEADER: Final = b"agentcap-queue\x00\x01"
FRAME_MAGIC: Final = b"AQr1"
_HEAD: Final = struct.Struct("<4sII")
_LENGTH: Final = struct.Struct("<I")
FRAME_OVERHEAD: Final = _HEAD.size
#: The largest payload a frame may hold; a larger length field is corruption, not a record.
MAX_PAYLOAD: Final = 256 * 1024 * 1024

_pack = _HEAD.pack
_crc32 = zlib.crc32


def encode_frame(payload: bytes) -> bytes:
    """The frame that holds ``payload`` (see the module doc)."""
    size = len(payload)
    if size > MAX_PAYLOAD:
        raise ValueError(f"record of {size} bytes exceeds the {MAX_PAYLOAD} byte limit")
    return _pack(FRAME_MAGIC, size, _crc32(payload, _crc32(_LENGTH.pack(size)))) + payload


class Record(NamedTuple):
    """A complete record found by :func:`scan`: its payload and where its frame lies."""

    start: int
    end: int
    payload: bytes


@dataclass(slots=True)
class ScanResult:
    """What :func:`scan` found besides the records."""

    #: Offset just past the last complete record (where a reader continues, or a writer appends).
    end: int = 0
    #: Bytes skipped between complete records (lost blocks, garbage).
    skipped: int = 0
    #: Bytes after the last complete record that are not a complete frame (a torn last record).
    torn: int = 0


def _frame_end(data: bytes | memoryview, pos: int, limit: int) -> int:
    """The end of the complete frame at ``pos``; -1 when the bytes there are not a frame, -2 when
    they begin one that runs past ``limit`` (complete or not, more data would tell)."""
    if pos + FRAME_OVERHEAD > limit:
        return -2 if FRAME_MAGIC.startswith(bytes(data[pos : pos + 4])) else -1
    magic, size, crc = _HEAD.unpack_from(data, pos)
    if magic != FRAME_MAGIC or size > MAX_PAYLOAD:
        return -1
    end: int = pos + FRAME_OVERHEAD + size
    if end > limit:
        return -2
    if _crc32(data[pos + FRAME_OVERHEAD : end], _crc32(_LENGTH.pack(size))) != crc:
        return -1
    return end


def _next_frame(data: bytes, view: memoryview, pos: int, limit: int) -> int:
    """The start of the next complete frame after ``pos``, or -1."""
    probe = data.find(FRAME_MAGIC, pos + 1, limit)
    while probe >= 0:
        if _frame_end(view, probe, limit) >= 0:
            return probe
        probe = data.find(FRAME_MAGIC, probe + 1, limit)
    return -1


def scan(
    data: bytes, start: int = 0, result: ScanResult | None = None, *, at_eof: bool = True
) -> Iterator[Record]:
    """The complete records of ``data`` from offset ``start`` on, in order.

    ``result`` (if given) receives the end of the last complete record and what was skipped or
    torn. ``at_eof`` says that ``data`` holds the rest of the file; without it (a chunk of a
    longer file) the scan stops before a frame that runs past the end of ``data`` instead of
    calling it torn, and before bytes it cannot yet tell from a torn frame.
    """
    if result is None:
        result = ScanResult()
    limit = len(data)
    pos = start
    result.end = pos
    view = memoryview(data)
    while pos < limit:
        end = _frame_end(view, pos, limit)
        if end >= 0:
            result.end = end  # before the yield: a consumer may stop at this record
            yield Record(pos, end, bytes(view[pos + FRAME_OVERHEAD : end]))
            pos = end
            continue
        if end == -2 and not at_eof:
            return  # the rest of this frame is beyond the chunk
        found = _next_frame(data, view, pos, limit)
        if found < 0:
            if at_eof:
                result.torn += limit - pos
            return
        result.skipped += found - pos
        pos = found
        result.end = pos


def check_header(head: bytes) -> int | None:
    """The format version of a segment that starts with ``head``, or None when it is not one."""
    name = SEGMENT_HEADER[:-1]
    if len(head) < len(SEGMENT_HEADER) or not head.startswith(name):
        return None
    version: int = head[len(name)]
    return version
