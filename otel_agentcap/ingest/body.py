"""Request bodies read in bounded memory: counted as they stream in, decompressed incrementally
with a cap, and checked to their end.

A gzip body is inflated chunk by chunk and never past the limit (a gzip bomb stops at the cap
with 413, after inflating at most one byte over it); its trailer is checked (zlib verifies the
CRC-32 and the length of every member), a body that ends before its trailer, inside a member or
at a flush point, is 400, and so is anything after the last member that is not another member.
Nothing of a body that fails is ever handed on.
"""

from __future__ import annotations

import zlib
from http import HTTPStatus
from typing import Final

#: Content-Encoding values accepted (OTLP/HTTP clients send gzip or nothing).
ENCODINGS: Final = frozenset({"identity", "gzip", "x-gzip"})


class BodyError(Exception):
    """A body that cannot be taken: the HTTP status to answer and why."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class BodyReader:
    """Collects one request body: :meth:`feed` each received chunk, then :meth:`finish`.

    ``limit`` bounds both the bytes received and the bytes after decompression.
    """

    __slots__ = ("_buffer", "_gzip", "_limit", "_members", "_received")

    def __init__(self, encoding: str, limit: int) -> None:
        encoding = encoding.strip().lower() or "identity"
        if encoding not in ENCODINGS:
            raise BodyError(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"unsupported Content-Encoding {encoding!r}; send gzip or no encoding",
            )
        self._limit = limit
        self._received = 0
        self._buffer = bytearray()
        self._gzip = zlib.decompressobj(31) if encoding != "identity" else None
        self._members = 0

    @property
    def size(self) -> int:
        """Bytes of (decompressed) body collected so far."""
        return len(self._buffer)

    def _too_large(self) -> BodyError:
        return BodyError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"request body over {self._limit} bytes (after decompression)",
        )

    def feed(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._received > self._limit:
            raise self._too_large()
        if self._gzip is None:
            self._buffer += chunk
            return
        data = chunk
        while data:
            if self._gzip.eof:  # another gzip member follows the last one
                self._gzip = zlib.decompressobj(31)
            room = self._limit - len(self._buffer) + 1  # one byte over tells it is too large
            try:
                out = self._gzip.decompress(data, room)
            except zlib.error as exc:
                raise BodyError(HTTPStatus.BAD_REQUEST, f"invalid gzip body: {exc}") from exc
            self._buffer += out
            if len(self._buffer) > self._limit:
                raise self._too_large()
            if self._gzip.eof:
                self._members += 1
                data = self._gzip.unused_data
            else:
                data = self._gzip.unconsumed_tail

    def finish(self) -> bytearray:
        """The whole body; raises ``BodyError`` for a compressed body cut before its end."""
        if self._gzip is not None and not self._gzip.eof:
            raise BodyError(
                HTTPStatus.BAD_REQUEST,
                "gzip body ends before its trailer (truncated)"
                if self._received
                else "empty body with Content-Encoding gzip",
            )
        return self._buffer
