"""The mapping thread pauses between slices of its work while a writer stores (so the writer's
thread gets the GIL when its server answers, not after the interpreter's switch interval), and
only then: the pause changes no row, and costs nothing while the writers are idle."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.exporters.durable.delivery import Delivery
from otel_agentcap.exporters.durable.directory import QueueDirectory
from otel_agentcap.exporters.durable.queue import DiskQueue
from otel_agentcap.exporters.durable.records import encode_span
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.exporters.postgres import parallel as parallel_module
from otel_agentcap.exporters.postgres.exporter import Part, map_part
from otel_agentcap.exporters.postgres.one_pass import prepare_spans
from otel_agentcap.exporters.postgres.pacing import PAUSE_EVERY
from otel_agentcap.exporters.postgres.parallel import HANDOFF_PAUSE, WriterThreads
from otel_agentcap.exporters.postgres.writer import RunStartCache
from otel_agentcap.pipeline.span_attributes import attributes_of
from otel_agentcap.testing import capture_events


def _memory_spans(count: int) -> list[Any]:
    memory = oa.Memory("pause")
    run_id = f"pause-{uuid.uuid4().hex[:8]}"
    with capture_events() as captured, oa.run(run_id), oa.agent("writer"):
        for i in range(count):
            memory[f"k{i}"] = {"i": i}
    return [s for s in captured.spans if s.name == "memory_write"]


def test_the_one_pass_calls_pause_after_every_slice_and_builds_the_same_rows():
    spans = _memory_spans(3 * PAUSE_EVERY + 5)
    assert all(attr.EVENT_ID in attributes_of(s) for s in spans)
    calls: list[int] = []
    start = datetime(2026, 1, 1, tzinfo=UTC)
    paused = prepare_spans(
        spans, staging=False, known_start=lambda run: start, pause=lambda: calls.append(1)
    )
    plain = prepare_spans(spans, staging=False, known_start=lambda run: start)
    assert paused is not None and plain is not None
    assert len(calls) == 3
    # The COPY data holds every field of every row.
    assert paused.data is not None and paused.data == plain.data
    assert paused.span_data == plain.span_data and paused.events == plain.events == len(spans)


def test_the_general_mapping_calls_pause_after_every_slice_and_builds_the_same_rows() -> None:
    """A batch the one pass declines (here: the run's root span is in it) is mapped span by span
    on the same thread: it pauses after every slice of spans too, and maps the same rows."""
    memory = oa.Memory("pause")
    run_id = f"pause-{uuid.uuid4().hex[:8]}"
    with capture_events() as captured, oa.run(run_id), oa.agent("writer"):
        for i in range(3 * PAUSE_EVERY + 5):
            memory[f"k{i}"] = {"i": i}
    spans = list(captured.spans)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    assert prepare_spans(spans, staging=False, known_start=lambda run: start) is None
    starts = RunStartCache()
    starts.update({run_id: start})
    calls: list[int] = []
    # All from the general path: the one pass declines on sight, before any slice of spans
    # (see the test below).
    paused = map_part(Part(0, spans), starts, lambda: calls.append(1))
    plain = map_part(Part(0, spans), starts)
    assert paused.error is None and paused.prepared is not None and plain.prepared is not None
    assert len(calls) == len(spans) // PAUSE_EVERY
    assert paused.data is not None and paused.data == plain.data
    assert paused.span_data == plain.span_data
    # Every write, and the agent's start and end.
    assert len(paused.prepared.events) == 3 * PAUSE_EVERY + 5 + 2


@pytest.mark.parametrize("last", ["run root", "model call"])
def test_the_one_pass_declines_on_sight_before_it_maps_a_span(last: str) -> None:
    """A batch the one pass declines because of a span's kind (a run's root span, a model call)
    is declined before any span is mapped, wherever that span is: the general path maps the whole
    batch again, so the mapping of the spans ahead of it would be thrown away."""
    memory = oa.Memory("pause")
    run_id = f"pause-{uuid.uuid4().hex[:8]}"
    with capture_events() as captured, oa.run(run_id), oa.agent("writer"):
        for i in range(3 * PAUSE_EVERY):
            memory[f"k{i}"] = {"i": i}
    spans: list[Any] = [s for s in captured.spans if s.name == "memory_write"]
    if last == "run root":
        spans += [s for s in captured.spans if attributes_of(s).get(attr.RUN_ROOT) is True]
    else:
        write = spans[-1]
        model_call = {**attributes_of(write), attr.EVENT_TYPE: "model_call"}
        model_call[attr.EVENT_ID] = str(uuid.uuid4())
        spans.append(
            ReadableSpan(
                name="chat",
                context=write.context,
                attributes=model_call,
                start_time=write.start_time,
                end_time=write.end_time,
                resource=write.resource,
            )
        )
    start = datetime(2026, 1, 1, tzinfo=UTC)
    calls: list[int] = []
    declined = prepare_spans(
        spans, staging=False, known_start=lambda run: start, pause=lambda: calls.append(1)
    )
    assert declined is None
    assert calls == []  # no slice of spans was mapped
    # Without that span the same spans take the one pass, slice by slice.
    assert prepare_spans(
        spans[:-1], staging=False, known_start=lambda run: start, pause=lambda: calls.append(1)
    )
    assert len(calls) == 3


def test_writers_pause_the_caller_only_while_one_of_them_stores(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(parallel_module.time, "sleep", slept.append)
    # The writers connect only when a job uses their connection: none here does.
    writers = WriterThreads("host=/nonexistent dbname=none", 2)
    try:
        writers.pause()
        assert slept == []  # idle writers: no pause
        storing, release = threading.Event(), threading.Event()

        def store(_writer: object) -> None:
            storing.set()
            release.wait(10)

        done = writers.submit(1, store)
        assert storing.wait(10)
        writers.pause()
        assert slept == [HANDOFF_PAUSE]
        release.set()
        done.result(10)
        writers.pause()
        assert slept == [HANDOFF_PAUSE]
    finally:
        release.set()
        writers.close()


def test_delivery_pauses_while_it_decodes_records_read_back_from_disk(
    pg_dsn: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records read back from disk (a backlog, an adopted queue) are decoded on the delivery
    thread too: it calls the pause after every slice of them; every event is still stored."""
    spans = _memory_spans(4 * PAUSE_EVERY)
    exporter = PostgresSpanExporter(pg_dsn, writers=1)
    calls: list[int] = []
    real_pause = exporter.pause_for_writers

    def counted_pause() -> None:
        calls.append(1)
        real_pause()

    monkeypatch.setattr(exporter, "pause_for_writers", counted_pause)
    queue = DiskQueue(QueueDirectory(tmp_path / "queue", pg_dsn), faults=FaultLog())
    for span in spans:
        queue.put(encode_span(span), 1, None)  # no span kept in memory: decoded from its record
    queue.sync()
    delivery = Delivery(queue, exporter, batch_spans=len(spans), schedule_delay=0.01)
    try:
        assert delivery.flush(60)
    finally:
        delivery.stop(5)
        queue.close(remove_if_empty=True)
        exporter.shutdown()
    assert exporter.stats().events_inserted == len(spans)
    # Decoding: one call per slice of records; mapping goes through the writers' own pause.
    assert len(calls) == len(spans) // PAUSE_EVERY
