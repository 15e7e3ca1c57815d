"""Instructions per call, counted by valgrind's callgrind: the benchmarks' ratios without noise.

CPU time on a shared 2-core machine moves by tens of percent between runs; the number of
instructions a call executes does not. This script runs each workload of ``bench_capture`` and
``bench_anthropic`` in its own process under callgrind, with counting switched on (through
``callgrind_control``) only around the measured calls, and prints instructions per call and the
same ratios the timing benchmarks print. With ``--delivery`` it counts instead the CPU work the
durable queue's delivery thread does per event before the writers send it (``prepare_parts``:
split by writer, then ``map_part`` for each share: the one pass, or map, prepare and COPY data)
on ``bench_pg_ingest``'s captured memory writes, the run's start known, in chunks of 2,000 spans
after one chunk of warm-up. Optionally (``--cache``) it also simulates the caches
and branch predictor and prints instruction-cache misses and branch mispredictions per call,
which is where a ratio in CPU time can differ from the ratio in instructions.

Instructions are not time: code that misses the instruction cache or mispredicts branches more
costs more per instruction, and callgrind does not see the kernel (OpenLLMetry runs
``asyncio.run()`` on every sync call, whose system calls cost time but few user instructions, so
its column is not comparable here). Read these figures next to the timing benchmarks, not
instead.

    .venv/bin/python bench/bench_instructions.py [--calls 300] [--cache] [--delivery]
        [--capture-only]

Needs ``valgrind`` (with ``callgrind_control``) on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPTURE = ("captured", "bare_span", "captured_linked", "bare_span_linked")
ANTHROPIC = tuple(
    f"{config}:{kind}" for kind in ("create", "stream") for config in ("bare", "a", "b", "b1", "c")
)
DELIVERY = ("delivery",)
DELIVERY_CHUNK = 2000
EVENTS = ("Ir", "I1mr", "Bcm", "Bim")


def _switch(on: bool) -> None:
    subprocess.run(
        ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
        check=True,
        capture_output=True,
    )


def _measure(
    call: Callable[[], object],
    warmup: int,
    calls: int,
    finish: Callable[[], object] = lambda: None,
) -> None:
    """Count ``calls`` calls and then ``finish()`` (configuration b maps its spans there).

    Objects alive after the warm-up are frozen out of the garbage collector's view: otherwise
    whether a full collection (which scans every import-time object) happens to fall inside the
    counted calls decides up to 5% of a configuration's overhead, and it moves with any change
    to the number of objects the process holds."""
    for _ in range(warmup):
        call()
    finish()
    gc.collect()
    gc.freeze()
    _switch(True)
    for _ in range(calls):
        call()
    finish()
    _switch(False)


def _delivery(calls: int) -> None:
    """``prepare_parts``' work for ``calls`` events (rounded up to whole chunks), as the
    exporter does it for two writers (``map_part`` for each writer's share), without a database,
    the run's start known (as it is once its first batch is stored)."""
    from bench_pg_ingest import make_spans

    from otel_agentcap import attributes as attr
    from otel_agentcap.exporters.postgres.exporter import Part, map_part
    from otel_agentcap.exporters.postgres.parallel import partition_of
    from otel_agentcap.exporters.postgres.writer import RunStartCache
    from otel_agentcap.pipeline.mapping import wall_time
    from otel_agentcap.pipeline.span_attributes import attributes_of

    chunks = -(-calls // DELIVERY_CHUNK)
    spans = make_spans((chunks + 1) * DELIVERY_CHUNK)
    pending = iter(range(0, len(spans), DELIVERY_CHUNK))
    run_starts = RunStartCache()
    first = attributes_of(spans[0])
    run_starts.update({str(first[attr.RUN_ID]): wall_time(spans[0].start_time)})  # type: ignore[attr-defined]

    def chunk() -> None:
        start = next(pending)
        shares: list[list[object]] = [[], []]
        for span in spans[start : start + DELIVERY_CHUNK]:
            attributes = attributes_of(span)
            shares[
                partition_of(attributes.get(attr.RUN_ID), attributes.get(attr.AGENT_ID), 2)
            ].append(span)
        for index, share in enumerate(shares):
            part = map_part(Part(index, share, direct=True), run_starts)  # type: ignore[arg-type]
            assert part.error is None and part.data is not None

    _measure(chunk, 1, chunks)


def _worker(workload: str, calls: int) -> None:
    sys.path.insert(0, str(HERE))
    if workload in DELIVERY:
        _delivery(calls)
        return
    if workload in CAPTURE:
        from bench_capture import DropExporter
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.trace import Link

        import otel_agentcap as oa
        from otel_agentcap.pipeline.processor import AgentCapSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(AgentCapSpanProcessor())
        recorded = DropExporter()
        provider.add_span_processor(SimpleSpanProcessor(recorded))
        trace.set_tracer_provider(provider)
        bare_provider = TracerProvider()
        bare_provider.add_span_processor(SimpleSpanProcessor(DropExporter()))
        bare_tracer = bare_provider.get_tracer("bench.bare")

        @oa.tool
        def lookup(city: str, days: int = 3) -> dict[str, object]:
            return {"city": city, "forecast": ["sun"] * days}

        counter = iter(range(10**9))
        with contextlib.ExitStack() as stack:
            stack.enter_context(oa.run("bench-run"))
            stack.enter_context(oa.agent("bench-agent"))
            links: list[Link] = []
            if workload.endswith("_linked"):
                # As bench_capture --caused-by: every captured call has a causal parent on another
                # span, so its span has a link; the bare span as many links, with as many
                # attributes.
                parent = oa.Memory("bench").set("key", 1)
                assert parent is not None
                stack.enter_context(oa.caused_by(parent))
                lookup.invoke("warmup", "Oslo")
                span = recorded.last["execute_tool lookup"]
                links = [Link(link.context, dict(link.attributes or {})) for link in span.links]
                assert links
            if workload.startswith("captured"):
                _measure(lambda: lookup.invoke(f"call-{next(counter)}", "Oslo", days=2), 500, calls)
            else:
                # As many attributes as the captured span ends with (bench_capture checks it).
                attributes = {f"bench.attr.{i}": f"value-{i}" for i in range(14)}
                _measure(
                    lambda: bare_tracer.start_span(
                        "execute_tool lookup", attributes=attributes, links=links
                    ).end(),
                    500,
                    calls,
                )
        return
    import bench_anthropic

    config, kind = workload.split(":")
    client, _, flush, scope = bench_anthropic._setup(config)
    fn = bench_anthropic.KINDS[kind]
    with scope:
        _measure(lambda: fn(client), 100, calls, flush)


def _run(workload: str, calls: int, cache: bool, out_dir: str) -> dict[str, float]:
    out = os.path.join(out_dir, f"callgrind.{workload.replace(':', '_')}")
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        *(["--cache-sim=yes", "--branch-sim=yes"] if cache else []),
        sys.executable,
        __file__,
        "--worker",
        workload,
        "--calls",
        str(calls),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{workload}: valgrind failed:\n{done.stderr[-2000:]}")
    header = Path(out).read_text().splitlines()
    names = next(line.split()[1:] for line in header if line.startswith("events:"))
    totals = next(line.split()[1:] for line in header if line.startswith("totals:"))
    counts = dict(zip(names, (int(v) for v in totals), strict=False))
    if workload in DELIVERY:
        calls = -(-calls // DELIVERY_CHUNK) * DELIVERY_CHUNK
    return {name: counts.get(name, 0) / calls for name in EVENTS}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--cache", action="store_true", help="simulate caches and branches")
    parser.add_argument(
        "--delivery", action="store_true", help="the delivery thread's work per event instead"
    )
    parser.add_argument(
        "--capture-only", action="store_true", help="only bench_capture's workloads"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.calls)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind with callgrind_control is needed", file=sys.stderr)
        return 2
    workloads = DELIVERY if args.delivery else CAPTURE if args.capture_only else CAPTURE + ANTHROPIC
    with tempfile.TemporaryDirectory() as out_dir, ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        results = dict(
            zip(
                workloads,
                pool.map(lambda w: _run(w, args.calls, args.cache, out_dir), workloads),
                strict=True,
            )
        )
    shown = EVENTS if args.cache else ("Ir",)
    unit = "event" if args.delivery else "call"
    print(f"per {unit}, from {args.calls} {unit}s each ({', '.join(shown)}; Ir = instructions)")
    for workload, counts in results.items():
        print(f"  {workload:14}" + "".join(f" {name}={counts[name]:>11,.0f}" for name in shown))
    if args.delivery:
        return 0
    captured, bare_span = results["captured"]["Ir"], results["bare_span"]["Ir"]
    print(f"captured tool call / bare span:  {captured / bare_span:.2f}  (target <= 2.0)")
    linked = results["captured_linked"]["Ir"] / results["bare_span_linked"]["Ir"]
    print(f"same, one causal parent (a link on both spans):  {linked:.2f}  (target <= 2.0)")
    for kind in () if args.capture_only else ("create", "stream"):
        base = results[f"bare:{kind}"]["Ir"]
        a, b, b1, c = (results[f"{config}:{kind}"]["Ir"] - base for config in ("a", "b", "b1", "c"))
        print(
            f"{kind:7} overhead b/a: {b / a:.2f}  (target <= 1.3)   b/c: {b / c:.2f}  (target <= 0.5)"
            f"   per-span mapping b1/a: {b1 / a:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
