"""The ``chat`` span of one call on an SDK without tracing, and the stream proxies that finish it.

A :class:`CallRecord` ends its span exactly once: when the stream is exhausted (status OK, or an
``api_error`` when it ended before ``message_stop``), when iteration fails (the error type), when
the caller closes it or leaves its ``with`` block (status unset), and when the caller drops it
(garbage collection: status unset). Telemetry failures are logged and swallowed; the user's
exceptions pass through unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import wrapt
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from otel_agentcap import private_parts
from otel_agentcap.instrumentation.anthropic import extractors

_logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    ObjectProxy = wrapt.ObjectProxy[Any]
else:
    # wrapt's proxy is generic (subscriptable) only from 2.0; opentelemetry-instrumentation up to
    # 0.61b0 requires wrapt < 2.
    ObjectProxy = wrapt.ObjectProxy


class CallRecord:
    """The span of one model call and how it ends."""

    def __init__(self, span: Span, start_ns: int) -> None:
        self.span = span
        self.accumulator = extractors.StreamAccumulator(start_ns)
        self._lock = threading.Lock()
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def event(self, event: Any) -> None:
        self.accumulator.add(event, time.time_ns())

    def finish(
        self,
        *,
        how: str,
        error: BaseException | None = None,
        message: Any = None,
    ) -> None:
        """End the span once. ``how``: ``read`` (exhausted), ``closed``, ``failed``, ``returned``
        (a complete non-streamed Message) or ``abandoned``."""
        with self._lock:
            if self._done:
                return
            self._done = True
        try:
            span = self.span
            completed = how == "read" and error is None and self.accumulator.stopped
            if message is not None:
                span.set_attributes(extractors.response_attributes(message))
            else:
                span.set_attributes(self.accumulator.final_attributes(completed=completed))
            if error is not None:
                span.set_attributes(extractors.error_attributes(error))
                if isinstance(error, Exception):
                    span.set_status(Status(StatusCode.ERROR))
            elif how == "returned" or completed:
                span.set_status(Status(StatusCode.OK))
            elif how == "read":
                # The stream ended before message_stop: the caller saw no error, the span fails.
                span.set_attribute("error.type", "api_error")
                span.set_status(Status(StatusCode.ERROR, "The stream ended before its end event."))
            span.end()
        except Exception:
            _logger.debug("agentcap: could not end a model-call span", exc_info=True)

    def observe(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """Yield the events of ``iterator``, recording each and how iteration ended."""
        try:
            for event in iterator:
                self.event(event)
                yield event
        except GeneratorExit:
            self.finish(how="closed")
            raise
        except BaseException as error:
            self.finish(how="failed", error=error)
            raise
        self.finish(how="read")

    async def aobserve(self, iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for event in iterator:
                self.event(event)
                yield event
        except GeneratorExit:
            self.finish(how="closed")
            raise
        except BaseException as error:
            self.finish(how="failed", error=error)
            raise
        self.finish(how="read")


def _abandoned(record: CallRecord) -> None:
    record.finish(how="abandoned")


def attach_to_stream(stream: Any, record: CallRecord, *, is_async: bool) -> None:
    """Route the SDK stream's event iterator through ``record`` and finish ``record`` when the
    stream object is garbage collected."""
    try:
        request_id = stream.response.headers.get("request-id")
        if isinstance(request_id, str):
            record.span.set_attribute("anthropic.request.id", request_id)
    except Exception:
        pass
    weakref.finalize(stream, _abandoned, record)
    # Beware: ``_iterator`` is the private generator an SDK ``Stream`` / ``AsyncStream`` reads
    # its events from; replacing it observes every event whichever public way the caller
    # iterates. Only SDKs without tracing of their own get here (anthropic 0.40 to 1.16; tested
    # at 0.40.0). Missing: one warning, and the call is recorded without its output.
    try:
        iterator = stream._iterator  # noqa: SLF001 (see above)
    except AttributeError:
        private_parts.missing(
            "anthropic",
            "Stream._iterator",
            "streamed model calls are recorded without usage, stop reason or content",
        )
        return
    stream._iterator = record.aobserve(iterator) if is_async else record.observe(iterator)  # noqa: SLF001


def _raw_stream(message_stream: Any) -> Any:
    """The SDK ``Stream`` under a ``MessageStream`` (``messages.stream(...)``).

    Beware: ``MessageStream._raw_stream`` is private; it is the one place the events of a
    ``messages.stream(...)`` call pass through. SDKs without tracing only (anthropic 0.40 to 1.16;
    tested at 0.40.0). Missing: an AttributeError the caller logs; the call ends unobserved.
    """
    return message_stream._raw_stream  # noqa: SLF001 (see above)


class _Proxy:
    """A stand-in for an SDK stream or stream manager that has the special methods its subclass
    defines and no others. ``wrapt.ObjectProxy`` defines ``__enter__``, ``__exit__`` and
    ``__iter__`` (and from wrapt 2 ``__aenter__`` / ``__aexit__``) whatever it wraps, so a sync
    stream or manager behind it looked like an async context manager (``hasattr(x,
    "__aenter__")``), an async one like a sync one, and a wrong ``with`` raised AttributeError
    instead of Python's TypeError. Other attributes are the wrapped object's (set and deleted
    there too, except this proxy's own ``_self_*`` ones); ``isinstance`` sees its class."""

    def __init__(self, wrapped: Any) -> None:
        object.__setattr__(self, "__wrapped__", wrapped)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # not set yet
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_self_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.__wrapped__, name, value)

    def __delattr__(self, name: str) -> None:
        if name.startswith("_self_"):
            object.__delattr__(self, name)
        else:
            delattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)


class TracedStream(_Proxy):
    """A ``Stream`` from ``messages.create(stream=True)`` whose span ends with it."""

    def __init__(self, wrapped: Any, record: CallRecord) -> None:
        super().__init__(wrapped)
        self._self_record = record
        attach_to_stream(wrapped, record, is_async=False)

    def __iter__(self) -> Any:
        return iter(self.__wrapped__)

    def __next__(self) -> Any:
        return next(self.__wrapped__)

    def close(self) -> None:
        try:
            self.__wrapped__.close()
        finally:
            self._self_record.finish(how="closed")

    def __enter__(self) -> TracedStream:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()


class TracedAsyncStream(_Proxy):
    """An ``AsyncStream`` from ``messages.create(stream=True)`` whose span ends with it."""

    def __init__(self, wrapped: Any, record: CallRecord) -> None:
        super().__init__(wrapped)
        self._self_record = record
        attach_to_stream(wrapped, record, is_async=True)

    def __aiter__(self) -> Any:
        return self.__wrapped__.__aiter__()

    async def __anext__(self) -> Any:
        return await self.__wrapped__.__anext__()

    async def close(self) -> None:
        try:
            await self.__wrapped__.close()
        finally:
            self._self_record.finish(how="closed")

    async def __aenter__(self) -> TracedAsyncStream:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.close()


class _ManagerBase(_Proxy):
    def __init__(self, wrapped: Any, start: Any) -> None:
        super().__init__(wrapped)
        self._self_start = start
        self._self_record: CallRecord | None = None


class TracedStreamManager(_ManagerBase):
    """A ``MessageStreamManager``: the span starts when the request is made (``__enter__``) and
    ends with the stream."""

    def __enter__(self) -> Any:
        record, scope = self._self_start()
        self._self_record = record
        try:
            with scope, trace.use_span(record.span, end_on_exit=False):
                message_stream = self.__wrapped__.__enter__()
        except BaseException as error:
            record.finish(how="failed", error=error)
            raise
        try:
            attach_to_stream(_raw_stream(message_stream), record, is_async=False)
            weakref.finalize(message_stream, _abandoned, record)
        except Exception:
            _logger.debug("agentcap: could not observe a message stream", exc_info=True)
        return message_stream

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        try:
            return self.__wrapped__.__exit__(exc_type, exc, tb)
        finally:
            if self._self_record is not None:
                self._self_record.finish(how="closed")


class TracedAsyncStreamManager(_ManagerBase):
    """An ``AsyncMessageStreamManager`` (see :class:`TracedStreamManager`)."""

    async def __aenter__(self) -> Any:
        record, scope = self._self_start()
        self._self_record = record
        try:
            with scope, trace.use_span(record.span, end_on_exit=False):
                message_stream = await self.__wrapped__.__aenter__()
        except BaseException as error:
            record.finish(how="failed", error=error)
            raise
        try:
            attach_to_stream(_raw_stream(message_stream), record, is_async=True)
            weakref.finalize(message_stream, _abandoned, record)
        except Exception:
            _logger.debug("agentcap: could not observe a message stream", exc_info=True)
        return message_stream

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        try:
            return await self.__wrapped__.__aexit__(exc_type, exc, tb)
        finally:
            if self._self_record is not None:
                self._self_record.finish(how="closed")


class CausalStreamManager(_Proxy):
    """A sync stream manager of a tracing SDK: binds the causal parents while the request is
    made. The sync context-manager protocol only, as the SDK's manager has."""

    def __init__(self, wrapped: Any, scope_factory: Any) -> None:
        super().__init__(wrapped)
        self._self_scope_factory = scope_factory

    def __enter__(self) -> Any:
        with self._self_scope_factory():
            return self.__wrapped__.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        return self.__wrapped__.__exit__(exc_type, exc, tb)


class CausalAsyncStreamManager(_Proxy):
    """An async stream manager of a tracing SDK (see :class:`CausalStreamManager`): the async
    context-manager protocol only."""

    def __init__(self, wrapped: Any, scope_factory: Any) -> None:
        super().__init__(wrapped)
        self._self_scope_factory = scope_factory

    async def __aenter__(self) -> Any:
        with self._self_scope_factory():
            return await self.__wrapped__.__aenter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        return await self.__wrapped__.__aexit__(exc_type, exc, tb)
