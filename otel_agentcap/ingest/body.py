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
_STEP: Final = 1024 * 1024


class BodyError(Exception):
    """A body that cannot be taken: the HTTP status to answer and why."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class BodyReader:
    """Collects one request body: :meth:`feed` each received chunk, then :meth:`finish`.

    ``limit`` bounds both the bytes received and the bytes after decompression.
    """

    __slots__ = ("_buffer", "_filled", "_gzip", "_limit", "_members", "_received")

    def __init__(self, encoding: str, limit: int, length: int | None = None) -> None:
        encoding = self.check_encoding(encoding)
        self._limit = limit
        self._received = 0
        self._gzip = zlib.decompressobj(31) if encoding != "identity" else None
        self._members = 0
        # A plain body of a declared length is read into one buffer of that size, never grown
        # (growing by reallocation can hold two copies for a moment).
        self._filled: int | None = None
        self._buffer = bytearray()
        if self._gzip is None and length is not None and 0 < length <= limit:
            self._buffer = bytearray(length)
            self._filled = 0

    @staticmethod
    def check_encoding(encoding: str) -> str:
        """``encoding`` normalised; raises ``BodyError`` (415) for one that is not accepted."""
        encoding = encoding.strip().lower() or "identity"
        if encoding not in ENCODINGS:
            raise BodyError(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"unsupported Content-Encoding {encoding!r}; send gzip or no encoding",
            )
        return encoding

    @property
    def size(self) -> int:
        """Bytes of (decompressed) body collected so far."""
        return len(self._buffer) if self._filled is None else self._filled

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
            filled = self._filled
            if filled is None:
                self._buffer += chunk
            elif filled + len(chunk) <= len(self._buffer):
                self._buffer[filled : filled + len(chunk)] = chunk
                self._filled = filled + len(chunk)
            else:  # more than declared (the HTTP layer refuses that first): keep it all
                del self._buffer[filled:]
                self._buffer += chunk
                self._filled = None
            return
        data = chunk
        while data:
            if self._gzip.eof:  # another gzip member follows the last one
                self._gzip = zlib.decompressobj(31)
            # One byte over the limit tells it is too large; at most 1 MiB per step, so the
            # output is never held twice over.
            room = min(self._limit - len(self._buffer) + 1, _STEP)
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
        """The whole body, handed over (the reader keeps no reference to it); raises
        ``BodyError`` for a compressed body cut before its end."""
        if self._filled is not None and self._filled < len(self._buffer):
            del self._buffer[self._filled :]  # fewer bytes than declared
        if self._gzip is not None and not self._gzip.eof:
            raise BodyError(
                HTTPStatus.BAD_REQUEST,
                "gzip body ends before its trailer (truncated)"
                if self._received
                else "empty body with Content-Encoding gzip",
            )
        body, self._buffer = self._buffer, bytearray()
        return body
