"""Collect what agentcap captured, for assertions in tests (like structlog's ``capture_logs``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_agentcap.model import AgentRecord, Event
from otel_agentcap.pipeline.mapping import batch_from_spans
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor, has_agentcap_processor
from otel_agentcap.pipeline.sampling import configured_sampler


class InMemoryEventExporter(SpanExporter):
    """A SpanExporter that keeps finished spans and maps them to events on demand."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    @property
    def spans(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    @property
    def events(self) -> list[Event]:
        """Every captured event, ordered by (run, agent, sequence); a model call recorded by several
        spans is one event, as in the event log."""
        events = batch_from_spans(self.spans).events
        return sorted(events, key=lambda e: (e.run_id, e.agent_id, e.seq))

    @property
    def agents(self) -> dict[tuple[str, str], AgentRecord]:
        """Agent rows by (run, agent), merged the way the event log merges them: the first known
        name and the first known lineage win."""
        merged: dict[tuple[str, str], AgentRecord] = {}
        for record in batch_from_spans(self.spans).agents:
            key = (record.run_id, record.agent_id)
            old = merged.get(key)
            if old is None:
                merged[key] = record
                continue
            lineage = old if old.lineage_known or not record.lineage_known else record
            merged[key] = AgentRecord(
                record.run_id,
                record.agent_id,
                name=old.name if old.name is not None else record.name,
                parent_agent_id=lineage.parent_agent_id,
                spawned_at_event_id=lineage.spawned_at_event_id,
                lineage_known=lineage.lineage_known,
            )
        return merged

    def of_type(self, event_type: str) -> list[Event]:
        return [e for e in self.events if e.event_type == event_type]

    def for_agent(self, agent_id: str) -> list[Event]:
        return [e for e in self.events if e.agent_id == agent_id]

    def by_id(self) -> dict[str, Event]:
        return {e.event_id: e for e in self.events}


class _FanOut(SpanProcessor):
    """Hands finished spans to the collectors active at the time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: list[InMemoryEventExporter] = []

    def add(self, sink: InMemoryEventExporter) -> None:
        with self._lock:
            self._sinks.append(sink)

    def remove(self, sink: InMemoryEventExporter) -> None:
        with self._lock:
            self._sinks.remove(sink)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            sinks = list(self._sinks)
        for sink in sinks:
            sink.export([span])


_install_lock = threading.Lock()
_fan_out: _FanOut | None = None


def _ensure_installed() -> _FanOut:
    """Attach the fan-out (and the agentcap processor if missing) to the global provider,
    creating an SDK provider if none is set. Done once per process."""
    global _fan_out
    with _install_lock:
        if _fan_out is not None:
            return _fan_out
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider(sampler=configured_sampler())  # every span recorded
            trace.set_tracer_provider(provider)
            provider = trace.get_tracer_provider()
            if not isinstance(provider, TracerProvider):
                raise RuntimeError(
                    "a non-SDK global TracerProvider is set; capture_events needs the SDK"
                )
        if not has_agentcap_processor(provider):
            provider.add_span_processor(AgentCapSpanProcessor())
        _fan_out = _FanOut()
        provider.add_span_processor(_fan_out)
        return _fan_out


@contextmanager
def capture_events() -> Iterator[InMemoryEventExporter]:
    """Collect the spans and events captured inside the block::

        with capture_events() as captured:
            run_my_agents()
        assert [e.event_type for e in captured.for_agent("planner")] == [...]

    Uses the global TracerProvider, installing an SDK one with the agentcap processor if none is
    set; collection is synchronous, so everything finished inside the block is there after it.
    """
    fan_out = _ensure_installed()
    sink = InMemoryEventExporter()
    fan_out.add(sink)
    try:
        yield sink
    finally:
        fan_out.remove(sink)
