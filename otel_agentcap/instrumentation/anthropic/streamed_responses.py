"""The response of a non-streamed ``messages.create`` read through ``with_streaming_response``, on
the SDK's own span.

The SDK records a response on its span when the call returns (a parsed Message, or a raw
response whose body is read: ``with_raw_response``). A response returned unread
(``with_streaming_response``) keeps the span open until the application has read, closed or
dropped its body, and then ends it with the status alone: no response id, usage, stop reason or
output, so the ``model_call`` event had none, listed no ``tool_use`` ids, and ``run_tool_uses``
could not find the model call that asked for the tools (no response id to look it up by).

Here the body of such a response passes through a reader that keeps its bytes; when the
application has read all of it, and before the SDK ends the span, the decoded body is recorded as
the SDK records a raw response read before the call returned (its own ``record_api_call`` and
``record_response`` with the decoded body as the result's data: response attributes, usage sums,
the requested ``tool_use`` ids through :func:`.patch.tool_use_ids_hook`, and the output only when
the client's content mode says so). A body closed or dropped unread, or that fails, records
nothing more, as before. The application's bytes are passed on unchanged.

Beware: private parts of the SDK, reached on purpose, since nothing public sees the body of an
unread response before its span ends: ``finish_api_call_span(client, span, result)`` where
``anthropic._base_client`` imports it (the one place a call's span is finished), the result's
fields (``ApiCallResult``: ``options``, ``response``, ``data``, ``error``, ``cast_to``), and
``record_api_call`` (``anthropic.lib._tracing._api_call``) and ``record_response``
(``anthropic._tracing``). Tested at anthropic 2.16. Missing, the instrumentor warns once and the
SDK records what it records on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from datetime import timedelta
from typing import Any, Final

from otel_agentcap import private_parts

_logger = logging.getLogger(__name__)

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

#: The module that calls ``finish_api_call_span`` (it imports the function by name).
CALLER_MODULE: Final = "anthropic._base_client"
FUNCTION: Final = "finish_api_call_span"
#: A body larger than this is passed on but not recorded (a Message is far smaller).
MAX_BODY_BYTES: Final = 32 * 1024 * 1024


def _missing(part: str) -> None:
    private_parts.missing(
        "anthropic",
        part,
        "a messages.create read through with_streaming_response records no response",
    )


def finish_hook() -> Wrapper:
    """Wraps ``finish_api_call_span(client, span, result)``: an unread non-streamed Message
    response is read through :class:`_BodyReader` (see the module documentation)."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        try:
            _follow(*args, **kwargs)
        except Exception:
            _logger.debug("agentcap: could not follow an unread response", exc_info=True)
        return wrapped(*args, **kwargs)

    return wrapper


def _follow(client: Any, span: Any, result: Any) -> None:
    import httpx2
    from anthropic import APIResponse, AsyncAPIResponse, AsyncStream, Stream
    from anthropic.types import Message
    from anthropic.types.beta import BetaMessage

    response = getattr(result, "response", None)
    cast_to = getattr(result, "cast_to", None)
    if (
        response is None
        or getattr(result, "error", None) is not None
        or not isinstance(cast_to, type)
        or not issubclass(cast_to, Message | BetaMessage)
        or not isinstance(getattr(result, "data", None), APIResponse | AsyncAPIResponse)
        or isinstance(result.data, Stream | AsyncStream)
        or not isinstance(response, httpx2.Response)
        or response.is_closed
        or not span.is_recording()
    ):
        return
    body = getattr(getattr(result, "options", None), "json_data", None)
    if isinstance(body, dict) and body.get("stream") is True:
        return  # a raw response of a stream: the SDK records it when it is parsed
    record = _recorder(client, span, result)
    if record is not None:
        response.stream = reader(response.stream, record)


def _recorder(client: Any, span: Any, result: Any) -> Callable[[bytes], None] | None:
    """What records the body, once read, on ``span``; None when the SDK lacks a part."""
    api_call = importlib.import_module("anthropic.lib._tracing._api_call")
    tracing = importlib.import_module("anthropic._tracing")
    record_api_call = getattr(api_call, "record_api_call", None)
    if not callable(record_api_call) or not callable(getattr(tracing, "record_response", None)):
        _missing("the tracing functions record_api_call / record_response")
        return None

    def record(raw: bytes) -> None:
        try:
            if not span.is_recording():
                return
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("type") != "message":
                return
            read = dataclasses.replace(result, data=data)
            record_api_call(client, span, read)
            # Looked up on each call: the instrumentor wraps it to add the tool_use ids.
            tracing.record_response(span, read)
        except Exception:
            _logger.debug("agentcap: could not record a response read later", exc_info=True)

    return record


class _Chunks:
    """The bytes of a body as it is read, up to :data:`MAX_BODY_BYTES`."""

    def __init__(self, record: Callable[[bytes], None]) -> None:
        self._record = record
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, chunk: bytes) -> None:
        if self._size <= MAX_BODY_BYTES:
            self._size += len(chunk)
            self._parts.append(chunk)

    def done(self) -> None:
        if self._size <= MAX_BODY_BYTES:
            self._record(b"".join(self._parts))
        self._parts = []


def reader(body: Any, record: Callable[[bytes], None]) -> Any:
    """A body of the same kind as ``body`` (sync, async or both, as httpx2 checks) that passes
    its bytes on and calls ``record`` with all of them once read to its end."""
    import httpx2

    sync_cls, async_cls, both_cls = _reader_classes()
    if not isinstance(body, httpx2.SyncByteStream):
        cls = async_cls
    elif isinstance(body, httpx2.AsyncByteStream):
        cls = both_cls
    else:
        cls = sync_cls
    return cls(body, _Chunks(record))


@functools.cache
def _reader_classes() -> tuple[type, type, type]:
    """The readers, made on first use: httpx2 is the HTTP client of the SDK releases that have
    the hooked function, and older ones do not install it."""
    import httpx2

    class _Reader:
        def __init__(self, body: Any, chunks: _Chunks) -> None:
            self._body = body
            self._chunks = chunks

        @property
        def elapsed(self) -> timedelta | None:
            """The wrapped body's ``elapsed``, which httpx2 reads from the response's stream."""
            return getattr(self._body, "elapsed", None)

    class SyncReader(_Reader, httpx2.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            chunks = iter(self._body)
            try:
                for chunk in chunks:
                    self._chunks.add(chunk)
                    yield chunk
                self._chunks.done()
            finally:
                # As ``yield from`` would: a body left part way is closed with this reader.
                if isinstance(chunks, Generator):
                    chunks.close()

        def close(self) -> None:
            self._body.close()

    class AsyncReader(_Reader, httpx2.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            chunks = self._body.__aiter__()
            try:
                async for chunk in chunks:
                    self._chunks.add(chunk)
                    yield chunk
                self._chunks.done()
            finally:
                if isinstance(chunks, AsyncGenerator):
                    await chunks.aclose()

        async def aclose(self) -> None:
            await self._body.aclose()

    class BothReader(SyncReader, AsyncReader):
        pass

    return SyncReader, AsyncReader, BothReader
