"""ingest.body: request bodies counted, inflated with a cap and checked to their end."""

from __future__ import annotations

import gzip
import zlib
from http import HTTPStatus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap.ingest.body import BodyError, BodyReader


def _feed(reader: BodyReader, data: bytes, cuts: list[int]) -> None:
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        reader.feed(data[start:cut])
        start = cut


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=5000), st.lists(st.integers(0, 6000), max_size=8), st.booleans())
def test_a_body_in_any_pieces_is_the_same_body(data, cuts, compressed):
    """A body fed in arbitrary pieces, plain or gzip (one or two members), comes out whole."""
    cuts = [c for c in cuts if c <= len(data)]
    if compressed:
        wire = gzip.compress(data[: len(data) // 2]) + gzip.compress(data[len(data) // 2 :])
        reader = BodyReader("gzip", 10_000)
    else:
        wire, reader = data, BodyReader("identity", 10_000)
    _feed(reader, wire, [c for c in cuts if c <= len(wire)])
    assert bytes(reader.finish()) == data


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=2000), st.data())
def test_a_gzip_body_cut_anywhere_is_refused(data, draw):
    """Every proper prefix of a gzip body (cut in the header, the data, at a flush point or in the
    trailer) is refused with 400 and gives nothing."""
    wire = gzip.compress(data)
    cut = draw.draw(st.integers(0, len(wire) - 1))
    reader = BodyReader("gzip", 10_000)
    with pytest.raises(BodyError) as info:
        reader.feed(wire[:cut])
        reader.finish()
    assert info.value.status is HTTPStatus.BAD_REQUEST


def test_a_gzip_bomb_stops_at_the_cap():
    """A gzip body that inflates past the limit is refused with 413 after inflating at most one
    byte over it."""
    limit = 1024 * 1024
    reader = BodyReader("gzip", limit)
    bomb = gzip.compress(b"\0" * (100 * limit))
    with pytest.raises(BodyError) as info:
        reader.feed(bomb)
    assert info.value.status is HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    assert reader.size <= limit + 1


def test_checksums_trailing_bytes_and_encodings_are_checked():
    """A wrong CRC or length, bytes after the last member, and an unknown encoding are refused;
    a plain body over the limit is 413."""
    whole = gzip.compress(b"payload" * 100)
    for body in (
        whole[:-8] + bytes([whole[-8] ^ 1]) + whole[-7:],
        whole[:-4] + bytes([whole[-4] ^ 1]) + whole[-3:],
        whole + b"junk",
        zlib.compress(b"zlib, not gzip"),
    ):
        reader = BodyReader("gzip", 10_000)
        with pytest.raises(BodyError):
            reader.feed(body)
            reader.finish()
    with pytest.raises(BodyError) as info:
        BodyReader("br", 10)
    assert info.value.status is HTTPStatus.UNSUPPORTED_MEDIA_TYPE
    reader = BodyReader("identity", 10)
    with pytest.raises(BodyError) as info:
        reader.feed(b"x" * 11)
    assert info.value.status is HTTPStatus.REQUEST_ENTITY_TOO_LARGE
