"""Ingest throughput of EventWriter versus the ceiling: raw binary COPY into agentcap.events.

Runs an embedded PostgreSQL in a temporary directory (deleted afterwards). Both methods write the
same rows (16 agents, ~600-byte payloads, batches of 2,000, one transaction per batch) into the
same, freshly truncated events table; rounds alternate and the medians are reported.

    .venv/bin/python bench/bench_pg_ingest.py [--events 60000] [--batch 2000] [--rounds 5]
        [--call-ids]

The durable queue is measured three ways on the same spans: delivery of spans handed over (records
on disk, spans in memory, as in normal operation), delivery of a backlog read back from disk (as
after a crash), and end to end (on_end of every span while delivery runs, in one process).

``--call-ids`` gives every model_call payload a response id and a request id, as real calls
have, so both methods also maintain the log's model-call indexes and the writer probes them.
``--writers`` sets the exporter's writer connections (default: the exporter's default).
``--interleave`` hands the spans over round-robin across the 16 agents, as agents working at the
same time end theirs, instead of agent after agent: every batch then holds all agents, so each
writer gets a share of it (agent after agent, a batch of 2,000 spans is mostly one agent, which
one writer stores).
``--switch-interval S`` runs everything with ``sys.setswitchinterval(S)``: how much of delivery's
time its writer threads spend waiting for the GIL while the delivery thread maps the next batch
(the interpreter's default is 0.005 s; a library must not change it for its host, so this is a
measurement, not a setting).
``--no-handoff-pause`` turns off what stands in for it: the mapping thread pausing 0.1 ms after
every 32 spans while a writer stores (``WriterThreads.pause``), to compare runs with and without.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres import embedded, partitions
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.rows import STAGING_COLUMNS
from otel_agentcap.exporters.postgres.writer import EventWriter
from otel_agentcap.model import AgentRecord, Batch, Event, RunRecord, SpanRecord, event_id_for

AGENTS = 16
RUN_ID = "bench-run"
COLUMNS = (*STAGING_COLUMNS[:11], ("run_started_at", "timestamptz"))


def make_payload(i: int, call_ids: bool = False) -> dict[str, object]:
    payload: dict[str, object] = {
        "gen_ai.request.model": "claude-sonnet-4-5",
        "messages": [
            {
                "role": "user",
                "content": f"Step {i}: summarise the findings of the previous tool call " * 3,
            },
            {
                "role": "assistant",
                "content": "The tool returned three documents; the second is relevant.",
            },
        ],
        "usage": {"input_tokens": 1200 + i % 97, "output_tokens": 180 + i % 13},
        "stop_reason": "end_turn",
    }
    if call_ids:
        payload["response_id"] = f"msg_{i:024d}"
        payload["request_id"] = f"req_{i:024d}"
    size = len(json.dumps(payload))
    payload["pad"] = "x" * max(0, 600 - size - 10)
    return payload


def make_batches(total: int, batch_size: int, call_ids: bool = False) -> list[Batch]:
    start = datetime(2025, 1, 1, tzinfo=UTC)
    events: list[Event] = []
    for i in range(total):
        agent = f"agent-{i % AGENTS:02d}"
        seq = i // AGENTS
        key = f"call-{seq}"
        parents = (event_id_for(RUN_ID, agent, f"call-{seq - 1}"),) if seq else ()
        events.append(
            Event(
                event_id=event_id_for(RUN_ID, agent, key),
                run_id=RUN_ID,
                agent_id=agent,
                seq=seq,
                event_type="model_call",
                idempotency_key=key,
                wall_time=start + timedelta(milliseconds=i),
                causal_parent_ids=parents,
                payload=make_payload(i, call_ids),
                trace_id="0af7651916cd43dd8448eb211c80319c",
                span_id=f"{i:016x}",
            )
        )
    agents = tuple(AgentRecord(RUN_ID, f"agent-{a:02d}", name=f"worker {a}") for a in range(AGENTS))
    runs = (RunRecord(RUN_ID, start, {"service": "bench"}),)
    return [
        Batch(tuple(events[i : i + batch_size]), agents, runs) for i in range(0, total, batch_size)
    ]


def reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE agentcap.events, agentcap.agents, agentcap.runs, agentcap.conflicts,"
            " agentcap.spans"
        )
        conn.execute("CHECKPOINT")


def run_copy(pool: ConnectionPool[psycopg.Connection[object]], batches: list[Batch]) -> float:
    names = ", ".join(n for n, _ in COLUMNS)
    types = [t for _, t in COLUMNS]
    query = f"COPY agentcap.events ({names}) FROM STDIN (FORMAT BINARY)".encode()
    count = 0
    with pool.connection() as conn:  # the partition of the runs' start, outside the timing
        partitions.ensure_partitions(conn, {r.started_at for b in batches for r in b.runs})
        conn.commit()
    t0 = time.perf_counter()
    for batch in batches:
        start = batch.runs[0].started_at
        with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            with cur.copy(query) as copy:
                copy.set_types(types)
                for e in batch.events:
                    copy.write_row(
                        (
                            e.event_id,
                            e.run_id,
                            e.agent_id,
                            e.seq,
                            e.wall_time,
                            e.event_type,
                            list(e.causal_parent_ids),
                            e.idempotency_key,
                            e.trace_id,
                            e.span_id,
                            Jsonb(e.payload),
                            start,
                        )
                    )
                    count += 1
            if batch.spans:
                _copy_spans(cur, batch.spans, start)
    return count / (time.perf_counter() - t0)


_SPAN_COPY = (
    b"COPY agentcap.spans (run_id, trace_id, span_id, parent_span_id, name, kind, start_time,"
    b" end_time, status_code, status_message, service_name, scope_name, run_started_at)"
    b" FROM STDIN (FORMAT BINARY)"
)
_SPAN_TYPES = (
    ["text"] * 5 + ["int2", "timestamptz", "timestamptz", "int2"] + ["text"] * 3 + ["timestamptz"]
)


def _copy_spans(cur: psycopg.Cursor[object], spans: Sequence[SpanRecord], start: datetime) -> None:
    """The span envelopes of a batch (what the exporter stores next to the events), by COPY,
    each with its run's start (the partition key)."""
    with cur.copy(_SPAN_COPY) as copy:
        copy.set_types(_SPAN_TYPES)
        for span in spans:
            copy.write_row((*span, start))


def run_writer(pool: ConnectionPool[psycopg.Connection[object]], batches: list[Batch]) -> float:
    writer = EventWriter(pool)
    writer.write(Batch())  # create the staging table outside the timing
    count = 0
    t0 = time.perf_counter()
    for batch in batches:
        result = writer.write(batch)
        count += result.inserted
    elapsed = time.perf_counter() - t0
    writer.close()
    return count / elapsed


def _uuid_batch(batch: Batch) -> Batch:
    """Event ids are str in the model; binary COPY of uuid columns needs UUID objects."""
    import uuid

    return Batch(
        tuple(
            e._replace(
                event_id=uuid.UUID(e.event_id),  # type: ignore[arg-type]
                causal_parent_ids=tuple(uuid.UUID(p) for p in e.causal_parent_ids),  # type: ignore[misc]
            )
            for e in batch.events
        ),
        runs=batch.runs,
        spans=batch.spans,
    )


def make_spans(total: int, interleave: bool = False) -> list[object]:
    """Real SDK spans from captured memory writes of 16 agents (~600-byte payloads each), agent
    after agent or, with ``interleave``, round-robin across the agents (each agent's own spans
    stay in order)."""
    import otel_agentcap as ac
    from otel_agentcap.testing import capture_events

    memory = ac.Memory("bench")
    with capture_events() as captured, ac.run("bench-spans"):
        for agent in range(AGENTS):
            with ac.agent(f"agent-{agent:02d}"):
                for i in range(total // AGENTS):
                    memory[f"k{agent}-{i % 50}"] = {"note": f"finding {i} " + "x" * 260}
    spans = [s for s in captured.spans if s.name == "memory_write"]
    if not interleave:
        return spans
    per_agent = [spans[a * (total // AGENTS) : (a + 1) * (total // AGENTS)] for a in range(AGENTS)]
    return [span for round_ in zip(*per_agent, strict=True) for span in round_]


def _writers(count: int | None) -> dict[str, int]:
    return {} if count is None else {"writers": count}


def run_exporter(
    dsn: str, spans: list[object], batch_size: int, writers: int | None = None
) -> float:
    from otel_agentcap.exporters.postgres import PostgresSpanExporter

    exporter = PostgresSpanExporter(dsn, **_writers(writers))
    exporter.export([])
    t0 = time.perf_counter()
    for start in range(0, len(spans), batch_size):
        exporter.export(spans[start : start + batch_size])  # type: ignore[arg-type]
    elapsed = time.perf_counter() - t0
    inserted = exporter.stats().events_inserted
    exporter.shutdown()
    return inserted / elapsed


def run_durable(
    dsn: str, spans: list[object], batch_size: int, root: Path, writers: int | None = None
) -> tuple[float, float, float]:
    """Through the durable queue, in events/s: (delivery, delivery from disk, end to end).

    Delivery: every span first handed over as ``on_end`` hands it over (its record appended to the
    queue on disk, the ended span kept in memory for delivery), not timed; then timed from the
    start of delivery until every event is stored: mapping and writing, as the exporter's figure
    above. From disk: the same records read back and decoded instead of taken from memory (what
    delivery does with a backlog that outgrew memory, or with the queue of a crashed process).
    End to end: a DurableSpanProcessor whose on_end gets every span while delivery runs, timed
    until everything is stored (one process does both, as an application does)."""
    from otel_agentcap.exporters.durable.delivery import Delivery
    from otel_agentcap.exporters.durable.directory import QueueDirectory
    from otel_agentcap.exporters.durable.processor import DurableSpanProcessor, QueueSettings
    from otel_agentcap.exporters.durable.queue import DiskQueue
    from otel_agentcap.exporters.durable.records import encode_span
    from otel_agentcap.exporters.faults import FaultLog
    from otel_agentcap.exporters.postgres import PostgresSpanExporter

    rates = []
    for name, memo in (("memory", True), ("disk", False)):
        reset(dsn)
        exporter = PostgresSpanExporter(dsn, **_writers(writers))
        exporter.export([])
        queue = DiskQueue(
            QueueDirectory(root / name, dsn), faults=FaultLog(), memo_limit=len(spans) + 1
        )
        for span in spans:
            queue.put(encode_span(span), 1, span if memo else None)
        queue.sync()
        t0 = time.perf_counter()
        delivery = Delivery(queue, exporter, batch_spans=batch_size, schedule_delay=0.01)
        assert delivery.flush(600)
        rates.append(exporter.stats().events_inserted / (time.perf_counter() - t0))
        delivery.stop(5)
        queue.close(remove_if_empty=True)
        exporter.shutdown()

    reset(dsn)
    exporter = PostgresSpanExporter(dsn, **_writers(writers))
    exporter.export([])
    processor = DurableSpanProcessor(
        exporter,
        QueueDirectory(root / "end-to-end", dsn),
        QueueSettings(batch_spans=batch_size, schedule_delay=0.01),
    )
    t0 = time.perf_counter()
    for span in spans:
        processor.on_end(span)  # type: ignore[arg-type]
    assert processor.flush(600)
    end_to_end = exporter.stats().events_inserted / (time.perf_counter() - t0)
    processor.close(5)
    return rates[0], rates[1], end_to_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--call-ids", action="store_true", help="response and request ids")
    parser.add_argument("--writers", type=int, default=None, help="the exporter's writers")
    parser.add_argument(
        "--interleave", action="store_true", help="spans round-robin across the agents"
    )
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run"
    )
    parser.add_argument(
        "--no-handoff-pause",
        action="store_true",
        help="the mapping thread never pauses for a writer (WriterThreads.pause does nothing)",
    )
    args = parser.parse_args()
    if args.no_handoff_pause:
        from otel_agentcap.exporters.postgres.parallel import WriterThreads

        WriterThreads.pause = lambda self: None  # type: ignore[method-assign]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    batches = make_batches(args.events, args.batch, args.call_ids)
    from otel_agentcap.pipeline.mapping import batch_from_spans

    spans = make_spans(args.events, args.interleave)
    span_batches = [
        batch_from_spans(spans[i : i + args.batch])  # type: ignore[arg-type]
        for i in range(0, len(spans), args.batch)
    ]
    copy_batches = [_uuid_batch(b) for b in batches]
    # The fixtures (60,000 spans and their batches, millions of objects) are frozen out of the
    # garbage collector's view: a process that exports holds its spans only while they queue, and
    # full collections scanning the fixtures made the exporter's figure swing by 20% between runs
    # of the same code.
    gc.collect()
    gc.freeze()
    root = Path(tempfile.mkdtemp(prefix="agentcap-bench-"))
    try:
        dsn = embedded.start(root / "pg")
        migrate(dsn)
        with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
            copy_rates: list[float] = []
            writer_rates: list[float] = []
            span_copy_rates: list[float] = []
            exporter_rates: list[float] = []
            delivery_rates: list[float] = []
            from_disk_rates: list[float] = []
            end_to_end_rates: list[float] = []
            for round_number in range(args.rounds):
                reset(dsn)
                copy_rates.append(run_copy(pool, copy_batches))
                reset(dsn)
                writer_rates.append(run_writer(pool, batches))
                reset(dsn)
                span_copy_rates.append(run_copy(pool, [_uuid_batch(b) for b in span_batches]))
                reset(dsn)
                exporter_rates.append(run_exporter(dsn, spans, args.batch, args.writers))
                reset(dsn)
                delivery, from_disk, end_to_end = run_durable(
                    dsn, spans, args.batch, root / f"queue-{round_number}", args.writers
                )
                delivery_rates.append(delivery)
                from_disk_rates.append(from_disk)
                end_to_end_rates.append(end_to_end)
        copy_rate = statistics.median(copy_rates)
        writer_rate = statistics.median(writer_rates)
        print(
            f"events={args.events} batch={args.batch} agents={AGENTS} rounds={args.rounds}"
            f" call_ids={args.call_ids} writers={args.writers or 'default'}"
            f" interleave={args.interleave} switch_interval={sys.getswitchinterval()}"
            f" handoff_pause={not args.no_handoff_pause}"
        )
        print(
            f"raw binary COPY (ceiling): {copy_rate:>10,.0f} events/s  samples={[round(r) for r in copy_rates]}"
        )
        print(
            f"EventWriter:               {writer_rate:>10,.0f} events/s  samples={[round(r) for r in writer_rates]}"
        )
        print(f"ratio writer/ceiling:      {writer_rate / copy_rate:.2f}  (target >= 0.5)")
        span_copy = statistics.median(span_copy_rates)
        exporter_rate = statistics.median(exporter_rates)
        print(f"spans from captured memory writes: {len(spans)} ({AGENTS} agents)")
        print(
            f"raw binary COPY of their rows (events and span envelopes):"
            f"  {span_copy:>10,.0f} events/s  samples={[round(r) for r in span_copy_rates]}"
        )
        print(
            f"PostgresSpanExporter.export:    {exporter_rate:>10,.0f} events/s  samples={[round(r) for r in exporter_rates]}"
        )
        print(
            f"ratio exporter (mapping + write)/ceiling: {exporter_rate / span_copy:.2f}  (target >= 0.5)"
        )
        delivery_rate = statistics.median(delivery_rates)
        from_disk_rate = statistics.median(from_disk_rates)
        end_to_end_rate = statistics.median(end_to_end_rates)
        print(
            f"durable queue, delivery:        {delivery_rate:>10,.0f} events/s  samples={[round(r) for r in delivery_rates]}"
        )
        print(
            f"durable queue, from disk:       {from_disk_rate:>10,.0f} events/s  samples={[round(r) for r in from_disk_rates]}"
        )
        print(
            f"durable queue, end to end:      {end_to_end_rate:>10,.0f} events/s  samples={[round(r) for r in end_to_end_rates]}"
        )
        print(
            f"ratio durable delivery (mapping + write, records on disk)/ceiling: "
            f"{delivery_rate / span_copy:.2f}  (target >= 0.8)"
        )
        print(
            f"ratio durable delivery from disk (read + decode + mapping + write)/ceiling: "
            f"{from_disk_rate / span_copy:.2f}"
        )
        print(
            f"ratio durable end to end (on_end + delivery, one process)/ceiling: "
            f"{end_to_end_rate / span_copy:.2f}"
        )
    finally:
        embedded.destroy(root / "pg")


if __name__ == "__main__":
    main()
