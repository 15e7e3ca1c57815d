"""Durable delivery of handed-over spans with the exporter's one pass on and off, alternating.

For each round: a raw binary COPY of the same rows (events and span envelopes, as
``bench_pg_ingest`` copies them), then the durable queue's delivery of 60,000 handed-over spans
(records on disk, the ended spans kept in memory, as ``bench_pg_ingest`` measures it) with the
one pass (``exporters.postgres.one_pass``) and without it (every batch mapped, prepared and
encoded step by step, as before the one pass), in alternating order; with ``--no-pause`` also
the general path without the writers' hand-over pause (``WriterThreads.pause`` doing nothing).
Prints events/s, the ratio of the medians to raw COPY, and the process's CPU time per stored
event (the delivery thread and the writers).

    .venv/bin/python bench/bench_one_pass.py [--rounds 4] [--events 60000] [--no-pause]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_pg_ingest as base
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.durable.delivery import Delivery
from otel_agentcap.exporters.durable.directory import QueueDirectory
from otel_agentcap.exporters.durable.queue import DiskQueue
from otel_agentcap.exporters.durable.records import encode_span
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.exporters.postgres import PostgresSpanExporter, embedded
from otel_agentcap.exporters.postgres import exporter as exporter_module
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.parallel import WriterThreads
from otel_agentcap.pipeline.mapping import batch_from_spans

ONE_PASS = exporter_module.prepare_spans
PAUSE = WriterThreads.pause


def _general(*args: Any, **kwargs: Any) -> None:
    return None  # every batch takes the general path


def deliver(dsn: str, spans: list[Any], root: Path, batch: int) -> tuple[float, float]:
    """Events/s and CPU microseconds per event of one delivery of ``spans``."""
    exporter = PostgresSpanExporter(dsn)
    exporter.export([])
    queue = DiskQueue(QueueDirectory(root, dsn), faults=FaultLog(), memo_limit=len(spans) + 1)
    for span in spans:
        queue.put(encode_span(span), 1, span)
    queue.sync()
    t0, c0 = time.perf_counter(), time.process_time()
    delivery = Delivery(queue, exporter, batch_spans=batch, schedule_delay=0.01)
    assert delivery.flush(600)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stored = exporter.stats().events_inserted
    delivery.stop(5)
    queue.close(remove_if_empty=True)
    exporter.shutdown()
    return stored / wall, cpu / stored * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=2_000)
    parser.add_argument(
        "--no-pause",
        action="store_true",
        help="also the general path without the writers' hand-over pause",
    )
    args = parser.parse_args()
    spans = base.make_spans(args.events)
    copy_batches = [
        base._uuid_batch(batch_from_spans(spans[i : i + args.batch]))  # type: ignore[arg-type]
        for i in range(0, len(spans), args.batch)
    ]
    gc.collect()
    gc.freeze()
    root = Path(tempfile.mkdtemp(prefix="agentcap-one-pass-"))
    modes = (
        ("one pass", "general", "general, no pause") if args.no_pause else ("one pass", "general")
    )
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    copies: list[float] = []
    try:
        dsn = embedded.start(root / "pg")
        migrate(dsn)
        with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
            for round_number in range(args.rounds):
                base.reset(dsn)
                copies.append(base.run_copy(pool, copy_batches))
                shift = round_number % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    exporter_module.prepare_spans = ONE_PASS if mode == "one pass" else _general  # type: ignore[assignment]
                    WriterThreads.pause = (lambda self: None) if "no pause" in mode else PAUSE  # type: ignore[method-assign]
                    base.reset(dsn)
                    rate, cpu = deliver(dsn, spans, root / f"q{round_number}-{mode}", args.batch)
                    results[mode].append((rate, cpu))
                    print(
                        f"round {round_number}: {mode:17} {rate:>8,.0f} events/s {cpu:5.1f} us CPU/event"
                    )
    finally:
        exporter_module.prepare_spans = ONE_PASS
        WriterThreads.pause = PAUSE  # type: ignore[method-assign]
        embedded.destroy(root / "pg")
    copy = statistics.median(copies)
    print(f"raw binary COPY: {copy:>8,.0f} events/s  samples={[round(c) for c in copies]}")
    for mode, samples in results.items():
        rate = statistics.median(r for r, _ in samples)
        print(
            f"{mode:17}: {rate:>8,.0f} events/s, ratio to raw COPY {rate / copy:.2f}, CPU per event"
            f" {[round(c, 1) for _, c in samples]} us"
        )


if __name__ == "__main__":
    main()
