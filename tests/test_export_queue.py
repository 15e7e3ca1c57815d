"""The export queue: a full queue blocks (bounded) or drops, and every drop is counted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_agentcap.exporters.queue import EventLogSpanProcessor


class SlowExporter(SpanExporter):
    """Takes ``delay`` seconds per batch, and waits for ``gate`` first when one is given."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        self.delay = delay
        self.gate = gate
        self.exported = 0
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.gate is not None:
            self.gate.wait(30)
        time.sleep(self.delay)
        with self.lock:
            self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _burst(processor: EventLogSpanProcessor, threads: int, per_thread: int) -> None:
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("burst")

    def emit() -> None:
        for i in range(per_thread):
            tracer.start_span(f"span-{i}").end()

    workers = [threading.Thread(target=emit) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    provider.shutdown()


def test_block_loses_nothing_in_a_burst_the_exporter_cannot_keep_up_with():
    exporter = SlowExporter(delay=0.002)
    processor = EventLogSpanProcessor(exporter, max_queue_size=64, max_export_batch_size=32)
    _burst(processor, threads=4, per_thread=750)
    assert (exporter.exported, processor.dropped) == (3000, 0)


def test_drop_counts_every_span_it_drops():
    exporter = SlowExporter(delay=0.002)
    counted: list[int] = []
    processor = EventLogSpanProcessor(
        exporter,
        max_queue_size=64,
        max_export_batch_size=32,
        overflow="drop",
        on_drop=lambda span: counted.append(1),
    )
    _burst(processor, threads=4, per_thread=750)
    assert processor.dropped > 0
    assert exporter.exported + processor.dropped == 3000
    assert sum(counted) == processor.dropped


@pytest.mark.timeout(60)
def test_a_stalled_exporter_does_not_stall_every_span():
    """Past block_timeout the span is dropped and counted, and for a while later spans that meet a
    full queue are dropped at once instead of each waiting out the timeout."""
    gate = threading.Event()
    exporter = SlowExporter(gate=gate)
    processor = EventLogSpanProcessor(
        exporter, max_queue_size=16, max_export_batch_size=8, block_timeout=0.5
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("stall")
    started = time.monotonic()
    for i in range(200):
        tracer.start_span(f"span-{i}").end()
    elapsed = time.monotonic() - started
    gate.set()
    provider.shutdown()
    assert processor.dropped > 0
    assert exporter.exported + processor.dropped == 200
    # Each of the ~180 drops waiting 0.5 s would take 90 s; one wait is what it costs.
    assert elapsed < 20


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="overflow"):
        EventLogSpanProcessor(SlowExporter(), overflow="spill")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_timeout"):
        EventLogSpanProcessor(SlowExporter(), block_timeout=0)


_BURST = textwrap.dedent(
    """
    import json, sys
    import otel_agentcap as ac
    from otel_agentcap.configure import configure, exporter_of

    dsn, run_id, overflow, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    provider = configure(dsn, queue_size=128, overflow=overflow, announce=False)
    memory = ac.Memory("burst")
    with ac.run(run_id), ac.agent("writer"):
        for i in range(count):
            memory[f"k{i % 10}"] = i
    provider.shutdown()
    print(json.dumps(exporter_of(provider).stats().__dict__))
    """
)


@pytest.mark.storage
@pytest.mark.multiprocess
@pytest.mark.parametrize("overflow", ["block", "drop"])
def test_a_burst_through_configure_is_stored_or_counted(pg_dsn: str, overflow: str):
    """Writes far faster than one database connection stores them: with "block" every event is
    stored; with "drop" every event is stored or counted as dropped."""
    run_id = f"burst-{overflow}"
    count = 4000
    done = subprocess.run(
        [sys.executable, "-c", _BURST, pg_dsn, run_id, overflow, str(count)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM agentcap.events WHERE run_id = %s", (run_id,)
        ).fetchone()
    stored = row[0] if row else 0
    total = count + 2  # the writes, agent_start and agent_end
    assert stats["events_failed"] == 0
    assert stored + stats["events_dropped"] == total
    if overflow == "block":
        assert stats["events_dropped"] == 0
