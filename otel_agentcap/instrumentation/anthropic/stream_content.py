"""The output content of a raw ``messages.create(stream=True)`` on an SDK that traces itself.

In content mode the SDK records a stream's output only when a stream helper
(``messages.stream()``) shares the Message it accumulates; a stream read without a helper gets only
``message_start``, ``content_block_start`` and ``message_delta`` accumulated, so its span has no
output content. :func:`stream_content_hook` wraps the SDK's recorder
(``anthropic.lib._tracing._streaming.StreamedMessage.item``): for such a stream, with content on,
it accumulates every event with the SDK's own ``accumulate_event`` and shares that Message with the
recorder, as a helper would, so the span gets the streamed output (text and tool_use input) on
exactly the terms of a helper's stream: the whole Message after ``message_stop``, what was read
of it otherwise, nothing when an event could not be accumulated.

Private parts of the SDK, reached on purpose: ``StreamedMessage._content``, ``_shared_snapshot``,
``_request_headers`` (read with getattr); tested at anthropic 2.14 and 2.15. When one is missing
the hook does nothing (``_content`` missing: one warning) and the SDK records what it records on
its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from otel_agentcap import private_parts

_logger = logging.getLogger(__name__)

_STATE = "_agentcap_stream_content"

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class _Accumulated:
    """The Message a raw stream has made so far, by the SDK's accumulation of every event."""

    __slots__ = ("accumulate", "json_bufs", "message")

    def __init__(self, accumulate: Callable[..., Any]) -> None:
        self.accumulate = accumulate
        self.json_bufs: dict[int, bytes] = {}
        self.message: Any = None

    def snapshot(self) -> Any:
        return self.message

    def add(self, event: Any) -> None:
        self.message = self.accumulate(event, self.message, self.json_bufs)


def _accumulator(event: Any, headers: Any) -> Callable[..., Any] | None:
    from anthropic.lib.streaming._beta_messages import accumulate_event as beta_accumulate
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStartEvent
    from anthropic.types.beta import BetaRawMessageStartEvent

    if isinstance(event, BetaRawMessageStartEvent):
        return lambda event, snapshot, bufs: beta_accumulate(
            event=event, current_snapshot=snapshot, json_bufs=bufs, request_headers=headers
        )
    if isinstance(event, RawMessageStartEvent):
        return lambda event, snapshot, bufs: accumulate_event(
            event=event, current_snapshot=snapshot, json_bufs=bufs
        )
    return None


def _observe(recorder: Any, event: Any) -> None:
    state: _Accumulated | None = getattr(recorder, _STATE, None)
    if state is None:
        if getattr(event, "type", None) != "message_start":
            return
        if not hasattr(recorder, "_content"):
            private_parts.missing(
                "anthropic",
                "StreamedMessage._content",
                "a raw messages.create(stream=True) records no output with content on",
            )
        # Content off, or a helper shares its own Message: the SDK records the output itself.
        if not getattr(recorder, "_content", False):
            return
        if getattr(recorder, "_shared_snapshot", True) is not None:
            return
        accumulate = _accumulator(event, getattr(recorder, "_request_headers", None))
        if accumulate is None:
            return
        state = _Accumulated(accumulate)
        setattr(recorder, _STATE, state)
        recorder.share_snapshot(state.snapshot)
    try:
        state.add(event)
    except Exception:
        _logger.debug("agentcap: could not accumulate a stream event", exc_info=True)
        recorder.withhold_snapshot()  # as a helper does: no partial Message as output


def stream_content_hook() -> Wrapper:
    """Wraps ``StreamedMessage.item(event)`` (see the module documentation)."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        try:
            event = args[0] if args else kwargs.get("event")
            _observe(instance, event)
        except Exception:
            _logger.debug("agentcap: could not observe a stream event", exc_info=True)
        return wrapped(*args, **kwargs)

    return wrapper
