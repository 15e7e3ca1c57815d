"""What the durable queue costs the thread that ends a span, against the SDK's BatchSpanProcessor.

Two measurements, each in interleaved rounds, medians of the CPU time of the measuring thread
(``time.thread_time``: what other threads and processes do is not counted):

1. ``on_end`` alone, for the same ended spans (captured tool calls and memory writes, as the
   capture API makes them): the SDK's ``BatchSpanProcessor``, agentcap's in-memory
   ``EventLogSpanProcessor``, and ``DurableSpanProcessor`` with the default fsync policy
   (``interval``) and with ``always``.
2. A captured tool call from start to end (``tool.invoke`` inside an agent) through a provider
   with ``AgentCapSpanProcessor`` and either export processor: what an agent thread pays.

The durable queue delivers to a database that is not there (a closed port), so its records stay
on disk and delivery only retries in the background; its directory is a temporary one.

    .venv/bin/python bench/bench_queue.py [--rounds 15] [--spans 4000] [--calls 2000]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_agentcap as ac
from otel_agentcap.capture.tools import invocations
from otel_agentcap.exporters.durable.directory import QueueDirectory
from otel_agentcap.exporters.durable.processor import DurableSpanProcessor, QueueSettings
from otel_agentcap.exporters.postgres import PostgresSpanExporter
from otel_agentcap.exporters.queue import EventLogSpanProcessor
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor

NOWHERE = "postgresql://agentcap@127.0.0.1:1/none?connect_timeout=2"
_collected = InMemorySpanExporter()


class DropExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def make_spans(count: int) -> list[ReadableSpan]:
    """Ended spans of captured tool calls and memory writes (through the "collect" provider)."""
    memory = ac.Memory("bench")

    @ac.tool
    def lookup(city: str, days: int = 3) -> dict[str, object]:
        return {"city": city, "forecast": ["sun"] * days}

    _Switch.current = "collect"
    with ac.run("bench-queue"), ac.agent("bench"):
        for i in range(count // 2):
            lookup.invoke(f"call-{i}", "Oslo", days=2)
            memory[f"k{i % 50}"] = {"note": f"finding {i} " + "x" * 100}
    return list(_collected.get_finished_spans())


def durable(root: Path, name: str, fsync: str) -> DurableSpanProcessor:
    return DurableSpanProcessor(
        PostgresSpanExporter(NOWHERE, writers=1),
        QueueDirectory(root / name, NOWHERE),
        QueueSettings(fsync=fsync),  # type: ignore[arg-type]
    )


def per_call(fn: Callable[[], None], n: int) -> float:
    start = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - start) / n / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--spans", type=int, default=4000)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    invocations.max_completed = 1000
    root = Path(tempfile.mkdtemp(prefix="agentcap-bench-queue-"))
    try:
        providers: dict[str, TracerProvider] = {}
        collect = TracerProvider()
        collect.add_span_processor(AgentCapSpanProcessor())
        collect.add_span_processor(SimpleSpanProcessor(_collected))
        providers["collect"] = collect
        for name, export in (
            ("BatchSpanProcessor (SDK)", BatchSpanProcessor(DropExporter(), max_queue_size=10**7)),
            ("DurableSpanProcessor fsync=interval", durable(root, "calls", "interval")),
        ):
            provider = TracerProvider()
            provider.add_span_processor(AgentCapSpanProcessor())
            provider.add_span_processor(export)
            providers[name] = provider
        trace.set_tracer_provider(_Switch(providers))
        spans = make_spans(args.spans)
        processors: dict[str, SpanProcessor] = {
            "BatchSpanProcessor (SDK)": BatchSpanProcessor(DropExporter(), max_queue_size=10**7),
            "EventLogSpanProcessor (memory)": EventLogSpanProcessor(
                DropExporter(), max_queue_size=10**7
            ),
            "DurableSpanProcessor fsync=interval": durable(root, "interval", "interval"),
            "DurableSpanProcessor fsync=always": durable(root, "always", "always"),
        }
        gc.collect()
        gc.freeze()
        on_end: dict[str, list[float]] = {name: [] for name in processors}
        for round_number in range(args.rounds):
            names = list(processors)
            if round_number % 2:
                names.reverse()
            for name in names:
                processor = processors[name]
                on_end[name].append(
                    per_call(lambda p=processor: [p.on_end(s) for s in spans], len(spans))
                )

        # A captured tool call through each export processor.
        del providers["collect"]

        @ac.tool
        def lookup(city: str, days: int = 3) -> dict[str, object]:
            return {"city": city, "forecast": ["sun"] * days}

        counter = iter(range(10**9))

        def calls() -> None:
            for _ in range(args.calls):
                lookup.invoke(f"c-{next(counter)}", "Oslo", days=2)

        tool_call: dict[str, list[float]] = {name: [] for name in providers}
        with ac.run("bench-calls"), ac.agent("bench"):
            for name in providers:
                _Switch.current = name
                calls()  # warm up
            for round_number in range(args.rounds):
                names = list(providers)
                if round_number % 2:
                    names.reverse()
                for name in names:
                    _Switch.current = name
                    tool_call[name].append(per_call(calls, args.calls))

        base = statistics.median(on_end["BatchSpanProcessor (SDK)"])
        print(f"spans: {len(spans)} (tool calls and memory writes), rounds: {args.rounds}")
        print("on_end, CPU time of the ending thread (median):")
        for name, samples in on_end.items():
            value = statistics.median(samples)
            print(f"  {name:38s} {value:8.2f} us  ({value / base:5.1f} x SDK)")
        base = statistics.median(tool_call["BatchSpanProcessor (SDK)"])
        print("captured tool call, start to end (median):")
        for name, samples in tool_call.items():
            value = statistics.median(samples)
            print(f"  {name:38s} {value:8.2f} us  ({value / base:5.2f} x with the SDK's)")
        for processor in processors.values():
            if isinstance(processor, DurableSpanProcessor):
                processor.close(0.1)
            else:
                processor.shutdown()
        for provider in providers.values():
            for active in provider._active_span_processor._span_processors:
                if isinstance(active, DurableSpanProcessor):
                    active.close(0.1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _Switch(TracerProvider):
    """A global provider that hands out the tracer of the provider being measured."""

    current = ""

    def __init__(self, providers: dict[str, TracerProvider]) -> None:
        super().__init__()
        self._providers = providers

    def get_tracer(self, *args: object, **kwargs: object) -> trace.Tracer:
        return _SwitchTracer(self._providers)


class _SwitchTracer(trace.Tracer):
    def __init__(self, providers: dict[str, TracerProvider]) -> None:
        self._tracers = {name: p.get_tracer("bench") for name, p in providers.items()}

    def start_span(self, *args: object, **kwargs: object) -> trace.Span:
        return self._tracers[_Switch.current].start_span(*args, **kwargs)  # type: ignore[arg-type]

    def start_as_current_span(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        return self._tracers[_Switch.current].start_as_current_span(*args, **kwargs)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
