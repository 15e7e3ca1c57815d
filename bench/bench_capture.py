"""Cost of a captured tool call relative to a bare OpenTelemetry SDK span.

Captured: ``tool.invoke(...)`` inside an agent, through a TracerProvider with
AgentCapSpanProcessor and a SimpleSpanProcessor whose exporter drops everything.
Baseline: a span started and ended on a second TracerProvider with the same SimpleSpanProcessor
and exporter (no agentcap processor), carrying as many attributes as the captured span.

The invocation registry is made small (``--registry``), so every timed call runs in the steady
state of a long-running process: the registry is full and forgets its oldest outcome on each call.

Rounds of both are interleaved; the medians of the per-call costs are reported. Costs are this
process's CPU time (everything runs synchronously in it), which other processes on the machine do
not inflate.

    .venv/bin/python bench/bench_capture.py [--rounds 30] [--calls 2000] [--registry 1000]
        [--caused-by] [--profile] [--breakdown]

``--breakdown`` also times the SDK's share of a captured call: a span started on the captured
provider as a tool call starts its span (the same two attributes, links and parent context), given
the captured span's other attributes the same way (written directly, see
``pipeline/span_attributes``), and ended. The rest of a captured call is agentcap's own work.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.capture.tools import invocations
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor
from otel_agentcap.pipeline.span_attributes import add_attributes


class DropExporter(SpanExporter):
    def __init__(self) -> None:
        self.seen = 0
        self.last: dict[str, ReadableSpan] = {}

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.seen += len(spans)
        if self.seen < 10:
            for span in spans:
                self.last[span.name] = span
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument(
        "--registry", type=int, default=1000, help="finished invocations the registry keeps"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the captured calls")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the SDK's share of a captured call (its span alone, attributes included)",
    )
    parser.add_argument(
        "--caused-by",
        action="store_true",
        help="every captured call has a causal parent on another span (so its span has a link)",
    )
    args = parser.parse_args()
    invocations.max_completed = args.registry

    captured_exporter = DropExporter()
    provider = TracerProvider()
    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(captured_exporter))
    trace.set_tracer_provider(provider)

    bare_exporter = DropExporter()
    bare_provider = TracerProvider()
    bare_provider.add_span_processor(SimpleSpanProcessor(bare_exporter))
    bare_tracer = bare_provider.get_tracer("bench.bare")

    @oa.tool
    def lookup(city: str, days: int = 3) -> dict[str, object]:
        return {"city": city, "forecast": ["sun"] * days}

    counter = iter(range(10**9))

    def captured_round(n: int) -> float:
        start = time.process_time_ns()
        for _ in range(n):
            lookup.invoke(f"call-{next(counter)}", "Oslo", days=2)
        return (time.process_time_ns() - start) / n / 1000

    with contextlib.ExitStack() as stack:
        stack.enter_context(oa.run("bench-run"))
        stack.enter_context(oa.agent("bench-agent"))
        if args.caused_by:
            parent = oa.Memory("bench").set("key", 1)
            assert parent is not None and parent.span is not None
            stack.enter_context(oa.caused_by(parent))
        lookup.invoke("warmup", "Oslo")
    span = captured_exporter.last["execute_tool lookup"]
    n_attributes = len(span.attributes or {})
    attributes = {f"bench.attr.{i}": f"value-{i}" for i in range(n_attributes)}
    # With --caused-by the bare span carries as many links (with as many attributes) too.
    links = [Link(link.context, dict(link.attributes or {})) for link in span.links]

    # The captured span's attributes, as a tool call writes them: two at the start, the rest
    # right after, the closing record at the end.
    captured_attributes = dict(span.attributes or {})
    start_attributes = {
        key: captured_attributes[key] for key in (attr.EVENT_ID, attr.GEN_AI_OPERATION_NAME)
    }
    closing = {attr.OUTCOME: captured_attributes.pop(attr.OUTCOME)}
    sdk_tracer = provider.get_tracer("otel_agentcap")

    def sdk_share_round(n: int) -> float:
        var = tel.context_var
        start = time.process_time_ns()
        for _ in range(n):
            own_links = [Link(link.context, dict(link.attributes or {})) for link in links]
            parent = var.get() if var is not None else None
            started = sdk_tracer.start_span(
                "execute_tool lookup", parent, attributes=start_attributes, links=own_links
            )
            add_attributes(started, captured_attributes, in_order=True)
            add_attributes(started, closing)
            started.end()
        return (time.process_time_ns() - start) / n / 1000

    def bare_round(n: int) -> float:
        start = time.process_time_ns()
        for _ in range(n):
            bare_tracer.start_span("execute_tool lookup", attributes=attributes, links=links).end()
        return (time.process_time_ns() - start) / n / 1000

    captured_costs: list[float] = []
    bare_costs: list[float] = []
    sdk_costs: list[float] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(oa.run("bench-run", resume=True))
        stack.enter_context(oa.agent("bench-agent"))
        if args.caused_by:
            stack.enter_context(oa.caused_by(parent))
        captured_round(args.calls)  # warm up
        bare_round(args.calls)
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            captured_round(args.calls * 5)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        gc.collect()
        for i in range(args.rounds):
            # Alternate which goes first, so drift and cache effects hit both equally.
            if i % 2 == 0:
                captured_costs.append(captured_round(args.calls))
                bare_costs.append(bare_round(args.calls))
            else:
                bare_costs.append(bare_round(args.calls))
                captured_costs.append(captured_round(args.calls))
            if args.breakdown:
                sdk_costs.append(sdk_share_round(args.calls))

    captured = statistics.median(captured_costs)
    bare = statistics.median(bare_costs)
    print(f"attributes per span:          {n_attributes}")
    print(f"links per span:               {len(links)}")
    print(f"rounds x calls:               {args.rounds} x {args.calls}")
    print(f"registry keeps (full):        {args.registry} outcomes")
    print(f"captured tool call (median):  {captured:8.2f} us")
    print(f"bare SDK span (median):       {bare:8.2f} us")
    if sdk_costs:
        sdk = statistics.median(sdk_costs)
        print(f"  its span in the SDK (median): {sdk:8.2f} us")
        print(f"  agentcap's own work:          {captured - sdk:8.2f} us  (captured less the span)")
    print(f"ratio:                        {captured / bare:8.2f}  (target <= 2.0)")


if __name__ == "__main__":
    main()
