"""Fast access to SDK spans, the one place that reaches into their private state.

The SDK hands attributes out as a ``MappingProxyType`` over ``BoundedAttributes``, whose
Python-level ``__getitem__`` makes every lookup cost about as much as a small function call; the
processor and the mapping read dozens per model call. :func:`attributes_of` returns the plain dict
inside when there is one (the public mapping is the fallback), for reading only. The ``events``
property copies the span's events; :func:`has_events` answers without the copy.

:func:`add_attributes` is the one write: the processor's stamps on a span that is starting, and the
closing event of a capture-API span; :func:`set_attributes_in_order` is the same write for the
attributes of a tool span that started with only a few of them.

Beware: private parts of the SDK's spans (``_attributes``, a ``BoundedAttributes`` with ``_dict``,
``_lock`` and ``_immutable``; ``_end_time``; ``_events``), read with ``getattr`` so that a release
without them takes the public path. Tested with opentelemetry-sdk 1.34 and 1.45. Missing: one
warning, and every read and write goes through the public API (slower, same result).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.util.types import AttributeValue

from otel_agentcap import private_parts

_EMPTY: Mapping[str, AttributeValue] = {}


def attributes_of(span: Any) -> Mapping[str, AttributeValue]:
    """The attributes of ``span`` (SDK span, ``ReadableSpan`` or anything with ``attributes``),
    not copied: never mutate the result."""
    held = getattr(span, "_attributes", None)
    inner = getattr(held, "_dict", None)
    if type(inner) is dict:
        return inner
    if type(held) is dict:  # a ReadableSpan built with a plain dict (by hand, or a copy)
        return held
    if held is not None and type(span).__module__.startswith("opentelemetry.sdk"):
        _sdk_parts_missing()  # an SDK span whose attributes are not what this module knows
    return getattr(span, "attributes", None) or _EMPTY


def _sdk_parts_missing() -> None:
    private_parts.missing(
        "opentelemetry-sdk",
        "ReadableSpan._attributes._dict",
        "span attributes are read and written through the public API (slower)",
    )


def add_attributes(
    span: Any, attributes: Mapping[str, AttributeValue], *, in_order: bool = False
) -> None:
    """Add ``attributes`` (valid attribute values: str, int, tuples of str) to the recording
    ``span``: a span processor's stamps in ``on_start``, or the closing event of a span the
    capture API started.

    ``Span.set_attributes`` cleans every value and takes two locks, which costs as much as the rest
    of the stamping; these values need no cleaning. The inner dict is written directly, under the
    attributes' own lock, only where that changes nothing the SDK would do: no attribute count
    limit reached, no value length limit configured (which would cut a value), span not ended.
    Otherwise the public API does it."""
    # Plain attribute reads (an AttributeError means: not an SDK span as this module knows it):
    # getattr() with a default costs several times as much, and this runs on every captured call.
    try:
        bounded = span._attributes  # noqa: SLF001 (see the module documentation)
        inner = bounded._dict  # noqa: SLF001
        lock = bounded._lock  # noqa: SLF001
        immutable = bounded._immutable  # noqa: SLF001
        ended = span._end_time  # noqa: SLF001
        direct = (
            type(inner) is dict
            and lock is not None
            and immutable is False
            and bounded.max_value_len is None
            and ended is None
        )
        maxlen = bounded.maxlen
    except AttributeError:
        direct = False
    if direct:
        with lock:
            if maxlen is None or len(inner) + len(attributes) <= maxlen:
                if in_order and inner.keys() <= attributes.keys():
                    inner.clear()  # see set_attributes_in_order
                inner.update(attributes)
                return
    span.set_attributes(attributes)


def set_attributes_in_order(span: Any, attributes: Mapping[str, AttributeValue]) -> None:
    """Add ``attributes`` (valid attribute values, as for :func:`add_attributes`) to the recording
    ``span`` so that it holds them in their order: a span the capture API started with a few of
    them (what a sampler and ``on_start`` see) ends as if it had been started with them all.

    The direct write (see :func:`add_attributes`) replaces the contents of the inner dict when
    every attribute the span has is among ``attributes``; when a span processor's ``on_start``
    added others, or the public API has to be used, the attributes are added (the span's own
    first, then the rest in order)."""
    add_attributes(span, attributes, in_order=True)


def has_events(span: Any) -> bool:
    """Whether ``span`` has span events, without copying them when it is an SDK span."""
    inner = getattr(span, "_events", None)
    return bool(inner) if inner is not None else bool(getattr(span, "events", None))
