"""Wrapper factories for ``Messages.create`` / ``Messages.stream`` (sync and async).

Two kinds:

* causal wrappers, for an SDK that traces itself: they add no span; they bind, around the request,
  the causal parents found in its ``tool_result`` blocks (see
  :mod:`otel_agentcap.pipeline.causal_links`), so the SDK's span, stamped by the processor when
  it starts, names them;
* span wrappers, for an SDK without tracing: the same, plus one ``chat`` span per call with the
  attribute names of the SDK's own tracing.

And :func:`tool_use_ids_hook`, which adds the requested ``tool_use`` ids to the SDK's own spans.
Every wrapper passes the user's arguments, results and exceptions through unchanged, except that a
call made for an agent execution that has timed out or failed is refused with
:class:`~otel_agentcap.AgentCancelled` before its request is sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer

from otel_agentcap.context import caused_by, current_agent
from otel_agentcap.instrumentation.anthropic import extractors
from otel_agentcap.instrumentation.anthropic.wrappers import (
    CallRecord,
    CausalAsyncStreamManager,
    CausalStreamManager,
    TracedAsyncStream,
    TracedAsyncStreamManager,
    TracedStream,
    TracedStreamManager,
)
from otel_agentcap.model import EventRef
from otel_agentcap.pipeline import causal_links

_logger = logging.getLogger(__name__)

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


def refuse_if_cancelled() -> None:
    """Raise :class:`~otel_agentcap.AgentCancelled` when the calling agent execution has timed out
    or failed: a model call from its abandoned thread or task is refused before the request is
    sent, like its tool, memory and spawn calls."""
    ctx = current_agent()
    if ctx is not None:
        ctx.check_active()


def request_parents(kwargs: dict[str, Any]) -> tuple[EventRef, ...]:
    """The recorded tool-result events of the tool results this request sends back (none outside
    an agent). Never raises."""
    try:
        ctx = current_agent()
        if ctx is None:
            return ()
        return causal_links.request_parents(ctx.run_id, kwargs.get("messages"), ctx.agent_id)
    except Exception:
        _logger.debug("agentcap: could not find the causes of a request", exc_info=True)
        return ()


def causal_scope(kwargs: dict[str, Any]) -> AbstractContextManager[None]:
    """``caused_by(...)`` the tool results this request sends back, or a no-op. Never raises."""
    parents = request_parents(kwargs)
    return caused_by(*parents) if parents else nullcontext()


# ----------------------------------------------------------------- SDKs that trace themselves


def causal_create() -> Wrapper:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        refuse_if_cancelled()
        parents = request_parents(kwargs)
        if not parents:  # most requests carry no tool results: no scope to enter
            return wrapped(*args, **kwargs)
        with caused_by(*parents):
            return wrapped(*args, **kwargs)

    return wrapper


def causal_acreate() -> Wrapper:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        refuse_if_cancelled()
        parents = request_parents(kwargs)
        if not parents:
            return wrapped(*args, **kwargs)

        async def call() -> Any:
            with caused_by(*parents):
                return await wrapped(*args, **kwargs)

        return call()

    return wrapper


def causal_stream(*, is_async: bool) -> Wrapper:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        refuse_if_cancelled()
        manager = wrapped(*args, **kwargs)
        try:
            proxy = CausalAsyncStreamManager if is_async else CausalStreamManager
            return proxy(manager, lambda: causal_scope(kwargs))
        except Exception:
            return manager

    return wrapper


def tool_use_ids_hook() -> Wrapper:
    """Wraps the SDK's ``set_response_attributes(span, span_name, data)``: also records the
    ids of the response's tool_use blocks (ids only, never content)."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            span = args[0] if args else kwargs.get("span")
            data = args[2] if len(args) > 2 else kwargs.get("data")
            attributes = extractors.tool_use_attributes(data)
            if attributes and span is not None:
                span.set_attributes(attributes)
        except Exception:
            _logger.debug("agentcap: could not record tool_use ids", exc_info=True)
        return result

    return wrapper


# ----------------------------------------------------------------- SDKs without tracing


def _start(tracer: Tracer, kwargs: dict[str, Any], *, stream: bool) -> CallRecord:
    start_ns = time.time_ns()
    attributes = extractors.request_attributes(kwargs, stream=stream)
    model = kwargs.get("model")
    name = f"chat {model}" if isinstance(model, str) else "chat"
    span = tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes, start_time=start_ns)
    return CallRecord(span, start_ns)


def _finish_result(record: CallRecord, result: Any, *, is_async: bool) -> Any:
    """Finish ``record`` for a returned value, or hand it to a stream proxy."""
    from anthropic import AsyncStream, Stream

    if isinstance(result, (Stream, AsyncStream)):
        try:
            return TracedAsyncStream(result, record) if is_async else TracedStream(result, record)
        except Exception:
            _logger.debug("agentcap: could not observe a stream", exc_info=True)
            record.finish(how="abandoned")
            return result
    http_response = getattr(result, "http_response", None)
    if http_response is not None:
        # A raw response (with_raw_response / with_streaming_response): its body, when read.
        record.finish(how="returned", message=_read_body(record, http_response))
        return result
    record.finish(how="returned", message=result)
    return result


def _read_body(record: CallRecord, http_response: Any) -> Any:
    """The decoded JSON body of a raw response that has been read (None when it has not, as a
    stream or a with_streaming_response body, or is no JSON object); its ``request-id`` header
    goes on the span. Never raises; never reads a body the caller has not read."""
    try:
        request_id = http_response.headers.get("request-id")
        if isinstance(request_id, str):
            record.span.set_attribute("anthropic.request.id", request_id)
        if not http_response.is_closed:
            return None
        content_type = str(http_response.headers.get("content-type", ""))
        if content_type.split(";")[0].strip().lower() != "application/json":
            return None
        data = http_response.json()
        return data if isinstance(data, dict) else None
    except Exception:
        _logger.debug("agentcap: could not read a raw response", exc_info=True)
        return None


def span_create(tracer: Tracer) -> Wrapper:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        refuse_if_cancelled()
        with causal_scope(kwargs):
            try:
                record = _start(tracer, kwargs, stream=kwargs.get("stream") is True)
            except Exception:
                _logger.debug("agentcap: could not start a model-call span", exc_info=True)
                return wrapped(*args, **kwargs)
            try:
                with trace.use_span(record.span, end_on_exit=False):
                    result = wrapped(*args, **kwargs)
            except BaseException as error:
                record.finish(how="failed", error=error)
                raise
        return _finish_result(record, result, is_async=False)

    return wrapper


def span_acreate(tracer: Tracer) -> Wrapper:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        refuse_if_cancelled()

        async def call() -> Any:
            with causal_scope(kwargs):
                try:
                    record = _start(tracer, kwargs, stream=kwargs.get("stream") is True)
                except Exception:
                    _logger.debug("agentcap: could not start a model-call span", exc_info=True)
                    return await wrapped(*args, **kwargs)
                try:
                    with trace.use_span(record.span, end_on_exit=False):
                        result = await wrapped(*args, **kwargs)
                except BaseException as error:
                    record.finish(how="failed", error=error)
                    raise
            return _finish_result(record, result, is_async=True)

        return call()

    return wrapper


def span_stream(tracer: Tracer, *, is_async: bool) -> Wrapper:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        refuse_if_cancelled()
        manager = wrapped(*args, **kwargs)

        def start() -> tuple[CallRecord, AbstractContextManager[None]]:
            scope = causal_scope(kwargs)
            scope.__enter__()
            try:
                record = _start(tracer, kwargs, stream=True)
            finally:
                scope.__exit__(None, None, None)
            return record, nullcontext()

        try:
            proxy = TracedAsyncStreamManager if is_async else TracedStreamManager
            return proxy(manager, start)
        except Exception:
            return manager

    return wrapper
