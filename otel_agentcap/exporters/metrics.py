"""Self-observability of the export path through the OpenTelemetry metrics API.

:func:`register` creates asynchronous instruments on a ``Meter`` of the global ``MeterProvider``
(a no-op until the application sets an SDK one; the API's proxy picks it up when it does). Their
callbacks read the same figures as ``AgentCap.stats()``, so nothing is counted twice and the
capture path pays nothing for them.

=============================== ============== ========================================
instrument                      unit           value
=============================== ============== ========================================
``agentcap.queue.spans``        ``{span}``     spans waiting in the queue (up-down)
``agentcap.queue.size``         ``By``         bytes of the queue's files (up-down)
``agentcap.export.events``      ``{event}``    events handled, by ``agentcap.result``:
                                               ``inserted``, ``duplicate``, ``conflict``,
                                               ``failed``, ``dropped``, ``unreadable``
``agentcap.export.retries``     ``{attempt}``  failed attempts that were retried
``agentcap.queue.spans.dropped`` ``{span}``    spans dropped (queue full, after shutdown)
``agentcap.queue.spans.adopted`` ``{span}``    spans taken over from ended processes
``agentcap.queue.spans.refused``  ``{span}``   spans the database refuses for good
``agentcap.queue.disk_errors``  ``{error}``    failed disk operations
=============================== ============== ========================================
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Final

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from otel_agentcap.version import __version__

METER_NAME: Final = "otel_agentcap"
RESULT: Final = "agentcap.result"

_EVENT_RESULTS: Final = (
    ("inserted", "events_inserted"),
    ("duplicate", "duplicates"),
    ("conflict", "conflicts"),
    ("failed", "events_failed"),
    ("dropped", "events_dropped"),
    ("unreadable", "events_unreadable"),
)


class _Snapshot:
    """One ``stats()`` call per collection, shared by the instruments' callbacks."""

    def __init__(self, owner: object, stats: Callable[[Any], Any]) -> None:
        self._owner = weakref.ref(owner)
        self._stats = stats
        self._lock = threading.Lock()
        self._at = 0.0
        self._value: Any = None

    def get(self) -> Any:
        owner = self._owner()
        if owner is None:
            return None
        with self._lock:
            now = time.monotonic()
            if self._value is None or now - self._at > 0.5:
                self._value = self._stats(owner)
                self._at = now
            return self._value


def register(
    owner: object,
    stats: Callable[[Any], Any],
    *,
    meter_provider: metrics.MeterProvider | None = None,
) -> None:
    """Report ``stats(owner)`` (an ``ExportStats``) through asynchronous instruments for as long
    as ``owner`` lives (it is held weakly)."""
    meter = metrics.get_meter(METER_NAME, __version__, meter_provider=meter_provider)
    snapshot = _Snapshot(owner, stats)

    def field(name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            value = snapshot.get()
            return [] if value is None else [Observation(int(getattr(value, name)))]

        return callback

    def events(options: CallbackOptions) -> Iterable[Observation]:
        value = snapshot.get()
        if value is None:
            return []
        return [Observation(int(getattr(value, f)), {RESULT: r}) for r, f in _EVENT_RESULTS]

    meter.create_observable_up_down_counter(
        "agentcap.queue.spans",
        [field("spans_queued")],
        unit="{span}",
        description="Spans waiting in the durable queue to be stored",
    )
    meter.create_observable_up_down_counter(
        "agentcap.queue.size",
        [field("bytes_queued")],
        unit="By",
        description="Bytes of the durable queue's files on disk",
    )
    meter.create_observable_counter(
        "agentcap.export.events",
        [events],
        unit="{event}",
        description="Events the export path handled, by result",
    )
    meter.create_observable_counter(
        "agentcap.export.retries",
        [field("failed_attempts")],
        unit="{attempt}",
        description="Attempts to store events that failed and were retried",
    )
    for name, attribute, description in (
        ("agentcap.queue.spans.dropped", "spans_dropped", "Spans dropped before storage"),
        ("agentcap.queue.spans.adopted", "spans_adopted", "Spans taken over from ended processes"),
        ("agentcap.queue.spans.refused", "spans_refused", "Spans the database refuses for good"),
    ):
        meter.create_observable_counter(
            name, [field(attribute)], unit="{span}", description=description
        )
    meter.create_observable_counter(
        "agentcap.queue.disk_errors",
        [field("disk_errors")],
        unit="{error}",
        description="Failed disk operations of the durable queue",
    )
