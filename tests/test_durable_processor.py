"""DurableSpanProcessor: what on_end has queued survives a SIGKILL, a full queue drops with a
count (or blocks, bounded), an agent's start is queued when it starts, and shutdown and flush
keep to their timeouts while the database is unreachable."""

from __future__ import annotations

import logging
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor

import otel_agentcap as ac
from otel_agentcap.exporters.durable.directory import QueueDirectory
from otel_agentcap.exporters.durable.processor import DurableSpanProcessor, QueueSettings
from otel_agentcap.exporters.durable.records import decode_span
from otel_agentcap.exporters.durable.segments import Position, SegmentReader
from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.exporters.postgres.exporter import _map
from otel_agentcap.testing import capture_events

UNREACHABLE = "postgresql://agentcap@127.0.0.1:1/none?connect_timeout=2"


class _Forward(SpanProcessor):
    """Added once to the global provider (which the capture API uses): forwards to the
    processor under test."""

    target: SpanProcessor | None = None

    def on_start(self, span, parent_context=None):
        if self.target is not None:
            self.target.on_start(span, parent_context)

    def on_end(self, span):
        if self.target is not None:
            self.target.on_end(span)


_forward = _Forward()


@pytest.fixture()
def durable(tmp_path) -> Iterator[Callable[..., DurableSpanProcessor]]:
    """Makes a DurableSpanProcessor on an unreachable database that sees every span the
    capture API (the global provider) starts and ends while the test runs."""
    with capture_events():  # installs an SDK provider with the agentcap processor if need be
        pass
    provider = trace.get_tracer_provider()
    if not getattr(_forward, "installed", False):
        provider.add_span_processor(_forward)  # type: ignore[attr-defined]
        _forward.installed = True  # type: ignore[attr-defined]
    made: list[DurableSpanProcessor] = []

    def make(
        dsn: str = UNREACHABLE, directory: Path | None = None, **settings: object
    ) -> DurableSpanProcessor:
        exporter = PostgresSpanExporter(dsn, writers=1)
        processor = DurableSpanProcessor(
            exporter,
            QueueDirectory(directory or tmp_path, dsn),
            QueueSettings(**settings),  # type: ignore[arg-type]
        )
        _forward.target = processor
        made.append(processor)
        return processor

    try:
        yield make
    finally:
        _forward.target = None
        for processor in made:
            processor.close(0.2)


def _records(queue_dir: Path) -> list[bytes]:
    out: list[bytes] = []
    for queue in sorted(queue_dir.glob("*/p-*")):
        reader = SegmentReader(queue, Position(0, 0))
        while batch := reader.read(1000, 1 << 24):
            out.extend(batch)
        reader.close()
    return out


_ENDER = textwrap.dedent(
    """
    import mmap, os, struct, sys
    from pathlib import Path
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry import trace
    from otel_agentcap.exporters.durable.directory import QueueDirectory
    from otel_agentcap.exporters.durable.processor import DurableSpanProcessor
    from otel_agentcap.exporters.postgres import PostgresSpanExporter
    from otel_agentcap import attributes as attr

    dsn = "postgresql://agentcap@127.0.0.1:1/none?connect_timeout=2"
    processor = DurableSpanProcessor(
        PostgresSpanExporter(dsn, writers=1), QueueDirectory(Path(sys.argv[1]), dsn)
    )
    fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 8)
    counter = mmap.mmap(fd, 8)
    tracer = TracerProvider().get_tracer("t")
    i = 0
    while True:
        span = tracer.start_span("s", attributes={attr.EVENT_ID: f"e{i}", "n": i, "pad": "x" * (i % 3000)})
        span.end()
        processor.on_end(span)
        i += 1
        counter[0:8] = struct.pack("<Q", i)
    """
)


@pytest.mark.multiprocess
@pytest.mark.fault
def test_a_sigkill_after_on_end_returns_loses_nothing(tmp_path):
    """A process killed at a random moment while it ends spans: every span whose on_end had
    returned is in its queue, complete (at most the one being ended may be missing)."""
    counter = tmp_path / "counter"
    proc = subprocess.Popen([sys.executable, "-c", _ENDER, str(tmp_path / "q"), str(counter)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = counter.exists() and counter.stat().st_size == 8
        if ready and struct.unpack("<Q", counter.read_bytes())[0] > 2000:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    ended = struct.unpack("<Q", counter.read_bytes())[0]
    found = [decode_span(r).attributes["n"] for r in _records(tmp_path / "q")]
    assert ended > 2000
    assert found[:ended] == list(range(ended))
    assert len(found) <= ended + 1


def test_a_full_queue_drops_with_a_count_under_drop(durable, tmp_path, caplog):
    """With the database down and the queue at its bound, overflow="drop" drops every further
    span at once, counts it and its events, and logs the condition once."""
    processor = durable(max_bytes=64 * 1024, overflow="drop")
    memory = ac.Memory("m")
    with caplog.at_level(logging.WARNING), ac.run("r"), ac.agent("a"):
        for i in range(400):
            memory[f"k{i}"] = "x" * 1000
    stats = processor.stats()
    exported = processor.exporter.stats()
    assert exported.spans_dropped > 0 and exported.events_dropped == exported.spans_dropped
    assert stats["bytes_queued"] <= 64 * 1024
    # The writes, the agent's start and end records, and the run's root span.
    assert stats["spans_enqueued"] + exported.spans_dropped == 400 + 3
    assert caplog.text.count("queue full") == 1


def test_spans_ending_after_shutdown_are_dropped_with_a_count_and_one_line(durable, caplog):
    """Capture goes on after the processor is shut down (the program keeps running): what ends
    then is dropped, counted, and logged once as such, not as a full queue."""
    processor = durable()
    processor.close(0.2)
    memory = ac.Memory("m")
    with caplog.at_level(logging.WARNING), ac.run("r"), ac.agent("a"):
        for i in range(5):
            memory[f"k{i}"] = i
    assert processor.exporter.stats().spans_dropped == 5 + 3
    closed = [r.getMessage() for r in caplog.records if "queue closed" in r.getMessage()]
    assert len(closed) == 1 and "spans that end after shutdown()" in closed[0]
    assert "queue full" not in caplog.text


def test_a_full_queue_blocks_once_then_drops_at_once_under_block(durable, tmp_path):
    """overflow="block" waits up to block_timeout for room once, then drops at once for a
    while, so a long outage does not stall every captured operation."""
    processor = durable(max_bytes=64 * 1024, overflow="block", block_timeout=0.5)
    memory = ac.Memory("m")
    slow = 0
    with ac.run("r"), ac.agent("a"):
        for i in range(300):
            started = time.monotonic()
            memory[f"k{i}"] = "x" * 1000
            slow += time.monotonic() - started > 0.3
    assert slow == 1
    assert processor.exporter.stats().spans_dropped > 0


def test_a_span_larger_than_the_queue_is_dropped_at_once_and_said_so(durable, caplog):
    """A span whose record alone exceeds the queue's bound can never fit: it is dropped and
    counted at once (no wait for room under "block"), logged once as what it is, and the spans
    after it are queued as usual."""
    # A block_timeout far above the bound below: a wait for room would fail the test at once,
    # and a slow machine does not.
    processor = durable(max_bytes=64 * 1024, overflow="block", block_timeout=6.0)
    memory = ac.Memory("m")
    with caplog.at_level(logging.WARNING), ac.run("r"), ac.agent("a"):
        started = time.monotonic()
        memory["big"] = "x" * 100_000
        memory["big2"] = "y" * 100_000
        took = time.monotonic() - started
        memory["small"] = 1
    exported = processor.exporter.stats()
    assert took < 3.0  # not block_timeout (6 s) for either
    assert (exported.spans_dropped, exported.events_dropped) == (2, 2)
    assert processor.stats()["spans_enqueued"] == 1 + 3  # the small write, start, end, root
    lines = [r.getMessage() for r in caplog.records if "span too large" in r.getMessage()]
    assert len(lines) == 1 and "larger than the queue's limit of 65,536 bytes" in lines[0]
    assert "queue full" not in caplog.text


def test_an_agents_start_is_queued_when_it_starts_and_sent_once(durable, tmp_path):
    """While an agent runs its agent_start is already on disk; the record of its ended span says
    so, and mapping both records yields agent_start once, in one batch or in two."""
    durable()
    tracer = trace.get_tracer("t")
    with ac.run("r"), ac.agent("a"):
        tracer.start_span("inner").end()
        running = [decode_span(r) for r in _records(tmp_path)]
    ended = [decode_span(r) for r in _records(tmp_path)]
    assert [s.attributes.get("agentcap.event.type") for s in running] == ["agent_start"]
    # The agent's end record says its start was queued; the run's root span comes last.
    (agent_end,) = [s for s in ended if s.own_event_queued]
    assert ended[-1].attributes.get("agentcap.run.root") is True
    together = [e.event_type for e in _map(ended, raw_payloads=True).events]
    apart = [e.event_type for e in _map([agent_end], raw_payloads=True).events]
    assert sorted(together) == ["agent_end", "agent_start"]
    assert apart == ["agent_end"]
    # The start record gives no envelope of the agent's span (it would be stored first, with
    # the span's start as its end); the end record gives it, with its end.
    assert not [e for e in _map(running, raw_payloads=True).spans if e.name == agent_end.name]
    (envelope,) = [e for e in _map(ended, raw_payloads=True).spans if e.name == agent_end.name]
    assert envelope.end_time > envelope.start_time


@pytest.mark.storage
def test_an_agents_start_kept_in_memory_is_stored_once(durable, pg_dsn, tmp_path):
    """With the queue in memory (its directory cannot be created) an agent's start is queued
    once: the log stores each event once and sees no duplicate."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    processor = durable(dsn=pg_dsn, directory=blocker / "queue")
    with ac.run("r-memory"), ac.agent("a"):
        ac.Memory("m")["k"] = 1
    assert processor.flush(30)
    assert processor.stats()["spans_in_memory"] > 0
    with psycopg.connect(pg_dsn) as conn:
        stored = conn.execute(
            "SELECT event_type, count(*) FROM agentcap.events WHERE run_id = 'r-memory'"
            " GROUP BY event_type ORDER BY event_type"
        ).fetchall()
    assert stored == [("agent_end", 1), ("agent_start", 1), ("memory_write", 1)]
    assert processor.exporter.stats().duplicates == 0


def test_an_agent_that_ends_once_the_disk_is_back_carries_its_start_kept_in_memory(
    durable, tmp_path
):
    """An agent whose start record went to memory (the disk refused it) and is not stored yet,
    and whose end goes to the disk once it is back: the end record carries agent_start itself,
    since the memory record dies with the process and the disk record does not."""
    blocker = tmp_path / "queue"
    blocker.write_text("not a directory")
    processor = durable(directory=blocker)  # the database is unreachable: nothing is stored
    with ac.run("r"), ac.agent("a"):
        assert processor.stats()["spans_in_memory"] == 1
        blocker.unlink()
        processor.queue._disk_retry_at = 0.0  # the disk is tried again now, not in 5 s
    ended = [decode_span(r) for r in _records(blocker)]
    (agent,) = [s for s in ended if s.attributes.get("agentcap.event.type") == "agent_start"]
    assert agent.end_time is not None and not agent.own_event_queued
    assert sorted(e.event_type for e in _map([agent], raw_payloads=True).events) == [
        "agent_end",
        "agent_start",
    ]


def test_shutdown_keeps_to_its_timeout_and_reports_what_it_left(durable, tmp_path, caplog):
    """With the database unreachable, close(timeout) returns within about the timeout, says in
    one line how many spans stay on disk, and leaves them there for a later process."""
    processor = durable()
    memory = ac.Memory("m")
    with ac.run("r"), ac.agent("a"):
        for i in range(50):
            memory[f"k{i}"] = i
    assert processor.flush(0.5) is False
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        report = processor.close(1.0)
    assert time.monotonic() - started < 2.5
    # The writes, the agent's start and end records, and the run's root span.
    assert report.spans_left == 50 + 3 and report.spans_lost == 0
    assert caplog.text.count("not yet stored") == 1
    assert len(_records(tmp_path)) == 50 + 3
    assert processor.close(1.0) is report


_FORKER = textwrap.dedent(
    """
    import os, sys
    import otel_agentcap as ac
    from otel_agentcap.configure import configure

    agentcap = configure(sys.argv[1], queue_dir=sys.argv[2], announce=False)
    memory = ac.Memory("m")
    with ac.run("run-fork"), ac.agent("before"):
        memory["k"] = 0
    pid = os.fork()
    name = "child" if pid == 0 else "parent"
    with ac.run("run-fork", resume=True), ac.agent(name):
        for i in range(200):
            memory[f"{name}-{i}"] = i
    agentcap.shutdown(timeout=30)
    if pid == 0:
        os._exit(0 if agentcap.stats().spans_left == 0 else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


@pytest.mark.storage
@pytest.mark.multiprocess
def test_a_forked_child_queues_and_delivers_its_own_spans(pg_dsn, tmp_path):
    """After a fork the child writes a queue of its own (never its parent's files) and both
    processes' events are stored, once each."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKER, pg_dsn, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    import psycopg

    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT agent_id, count(*) FROM agentcap.events WHERE run_id = 'run-fork' "
            "GROUP BY agent_id ORDER BY agent_id"
        ).fetchall()
        conflicts = conn.execute("SELECT count(*) FROM agentcap.conflicts").fetchone()
    assert rows == [("before", 3), ("child", 202), ("parent", 202)]
    assert conflicts == (0,)
    assert not list(tmp_path.glob("*/p-*"))


_FORK_THEN_DIE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from opentelemetry.sdk.trace import TracerProvider
    from otel_agentcap.exporters.durable.directory import QueueDirectory
    from otel_agentcap.exporters.durable.processor import DurableSpanProcessor
    from otel_agentcap.exporters.postgres import PostgresSpanExporter
    from otel_agentcap import attributes as attr

    dsn = "postgresql://agentcap@127.0.0.1:1/none?connect_timeout=2"
    processor = DurableSpanProcessor(
        PostgresSpanExporter(dsn, writers=1), QueueDirectory(Path(sys.argv[1]), dsn)
    )
    ready, said_ready = os.pipe()
    if os.fork() == 0:
        os.write(said_ready, b"x")  # its fork handlers have run (before fork() returned here)
        sys.stdin.read()  # lives until the test closes its stdin
        os._exit(0)
    os.read(ready, 1)  # killed only once the child gave up what it inherited
    span = TracerProvider().get_tracer("t").start_span("s", attributes={attr.EVENT_ID: "e1"})
    span.end()
    processor.on_end(span)
    print(processor.queue.own.name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.multiprocess
@pytest.mark.fault
def test_a_killed_parents_queue_is_adoptable_while_its_forked_child_lives(tmp_path):
    """A forked child does not keep its parent's queue locked: when the parent is killed, its
    queue is free for another process to adopt although the child still runs."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _FORK_THEN_DIE, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        name = parent.stdout.readline().strip()
        parent.wait(60)
        assert parent.returncode == -signal.SIGKILL
        directory = QueueDirectory(tmp_path, UNREACHABLE)
        adopted = []
        for locked in directory.adopt():
            adopted.append(locked.name)
            locked.release()
        assert name in adopted
    finally:
        assert parent.stdin is not None
        parent.stdin.close()  # the child (still holding the pipe) ends
