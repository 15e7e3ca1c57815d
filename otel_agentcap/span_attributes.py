"""Fast read access to SDK spans, the one place that reaches into their private state.

The SDK hands attributes out as a ``MappingProxyType`` over ``BoundedAttributes``, whose
Python-level ``__getitem__`` makes every lookup cost about as much as a small function call; the
processor and the mapping read dozens per model call. :func:`attributes_of` returns the plain dict
inside when there is one (the public mapping is the fallback), for reading only. The ``events``
property copies the span's events; :func:`has_events` answers without the copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.util.types import AttributeValue

_EMPTY: Mapping[str, AttributeValue] = {}


def attributes_of(span: Any) -> Mapping[str, AttributeValue]:
    """The attributes of ``span`` (SDK span, ``ReadableSpan`` or anything with ``attributes``),
    not copied: never mutate the result."""
    inner = getattr(getattr(span, "_attributes", None), "_dict", None)
    if type(inner) is dict:
        return inner
    return getattr(span, "attributes", None) or _EMPTY


def has_events(span: Any) -> bool:
    """Whether ``span`` has span events, without copying them when it is an SDK span."""
    inner = getattr(span, "_events", None)
    return bool(inner) if inner is not None else bool(getattr(span, "events", None))
