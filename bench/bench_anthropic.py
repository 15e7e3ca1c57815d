"""Per-call overhead of recording anthropic model calls, over an in-process transport.

Measures, in one run, ``messages.create`` non-streamed and streamed (20 text deltas), each
instrumented minus bare (same client setup, tracing off):

  (a) the SDK's own tracing alone (SimpleSpanProcessor to a null exporter),
  (b) (a) plus otel_agentcap: AgentCapSpanProcessor stamping inside an agent, the
      AnthropicInstrumentor's causal wrapper and tool_use-id hook, and the log mapping
      (mapping.batch_from_spans) of the spans, in batches as the PostgreSQL exporter maps them
      under configure()'s default BatchSpanProcessor: the spans of a timed block are mapped in one
      call at its end, inside the timed block, so every span's mapping is counted;
  (b1) as (b), but each span mapped alone as it ends (a SimpleSpanProcessor export path);
  (c) OpenLLMetry's opentelemetry-instrumentation-anthropic alone (SDK tracing off).

Every response has an id of its own (as real responses do), so no mapping in a batch takes two
calls for one.

Method: each configuration runs in a process of its own, set up once and warmed up, so every
instrumentor stays installed and the interpreter's specialised bytecode stays warm (installing and
removing instrumentors between blocks in one process would charge re-specialisation to them). A
coordinator then times short blocks of calls in each process, one process at a time, in an order
that rotates from round to round; a configuration's overhead in a round is its block minus that
round's bare block, and the figure is the median over rounds. Time is the worker's CPU time:
client, transport, span processors and exporter all run synchronously in it, and CPU time is not
inflated by other processes on the machine.

Targets: (b) <= 1.3 x (a) and (b) <= 0.5 x (c); (b1) is printed next to them.
Run: .venv/bin/python bench/bench_anthropic.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import anthropic
import httpx2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import otel_agentcap as ac
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor
from otel_agentcap.pipeline.mapping import batch_from_spans
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor

ROUNDS = 41
CALLS = 40
MODEL = "claude-bench"
MESSAGES = [{"role": "user", "content": "Hello"}]

MESSAGE = {
    "id": "msg_bench",
    "type": "message",
    "role": "assistant",
    "model": MODEL,
    "content": [{"type": "text", "text": "Hello there, this is a canned answer."}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 12,
        "output_tokens": 20,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
    },
}


def _sse() -> bytes:
    def event(name: str, data: dict[str, object]) -> str:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"

    start = {
        **MESSAGE,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": 12, "output_tokens": 1},
    }
    parts = [
        event("message_start", {"type": "message_start", "message": start}),
        event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
    ]
    for i in range(20):
        parts.append(
            event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": f"w{i} "},
                },
            )
        )
    parts += [
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 20},
            },
        ),
        event("message_stop", {"type": "message_stop"}),
    ]
    return "".join(parts).encode()


SSE = _sse()
JSON = json.dumps(MESSAGE).encode()


_responses = itertools.count()


def _handler(request: httpx2.Request) -> httpx2.Response:
    body = json.loads(request.content)
    # A response id and request id of its own for every call ("msg_bench" and "req_bench" are
    # replaced by ids of the same length, so every configuration does the same work).
    n = f"{next(_responses) % 10**6:06d}"
    headers = {"request-id": f"req_{n}"}
    if body.get("stream"):
        return httpx2.Response(
            200,
            content=SSE.replace(b"msg_bench", f"msg_{n}".encode(), 1),
            headers={**headers, "content-type": "text/event-stream"},
        )
    return httpx2.Response(
        200,
        content=JSON.replace(b"msg_bench", f"msg_{n}".encode(), 1),
        headers={**headers, "content-type": "application/json"},
    )


class NullExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class MappingExporter(SpanExporter):
    """What the PostgreSQL exporter does before I/O: map spans to log records. With ``batched``,
    spans are kept until :meth:`flush` maps them in one batch."""

    def __init__(self, batched: bool = False) -> None:
        self.events = 0
        self.batched = batched
        self.pending: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.batched:
            self.pending.extend(spans)
        else:
            self.events += len(batch_from_spans(spans).events)
        return SpanExportResult.SUCCESS

    def flush(self) -> None:
        if self.pending:
            self.events += len(batch_from_spans(self.pending).events)
            self.pending = []


def _client(open_telemetry: object) -> anthropic.Anthropic:
    http_client = httpx2.Client(transport=httpx2.MockTransport(_handler))
    return anthropic.Anthropic(
        api_key="bench-key",
        base_url="http://bench.invalid",
        http_client=http_client,
        max_retries=0,
        open_telemetry=open_telemetry,
    )  # type: ignore[arg-type]


def _plain(client: anthropic.Anthropic) -> None:
    client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)  # type: ignore[arg-type]


def _streamed(client: anthropic.Anthropic) -> None:
    for _ in client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
    ):
        pass


def _per_call_us(
    fn: Callable[[anthropic.Anthropic], None],
    client: anthropic.Anthropic,
    flush: Callable[[], None],
) -> float:
    start = time.process_time_ns()
    for _ in range(CALLS):
        fn(client)
    flush()
    return (time.process_time_ns() - start) / CALLS / 1000


CONFIGS = ("bare", "a", "b", "b1", "c")
MEASURED = ("a", "b", "b1", "c")
KINDS: dict[str, Callable[[anthropic.Anthropic], None]] = {"create": _plain, "stream": _streamed}


class Setup(NamedTuple):
    client: anthropic.Anthropic
    #: Events mapped so far.
    mapped: Callable[[], int]
    #: Ends a block of calls (maps the block's spans in configuration b).
    flush: Callable[[], None]
    scope: contextlib.ExitStack


def _nothing() -> None:
    return None


def _setup(config: str) -> Setup:
    """The client of ``config`` and what runs around its calls."""
    scope = contextlib.ExitStack()
    if config == "bare":
        return Setup(_client(False), lambda: 0, _nothing, scope)
    if config == "a":
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(NullExporter()))
        return Setup(_client({"tracer_provider": provider}), lambda: 0, _nothing, scope)
    if config in ("b", "b1"):
        mapping = MappingExporter(batched=config == "b")
        provider = TracerProvider()
        provider.add_span_processor(AgentCapSpanProcessor())
        provider.add_span_processor(SimpleSpanProcessor(mapping))
        AnthropicInstrumentor().instrument()
        scope.enter_context(ac.run("bench"))
        scope.enter_context(ac.agent("bench"))
        client = _client({"tracer_provider": provider})
        return Setup(client, lambda: mapping.events, mapping.flush, scope)
    if config == "c":
        from opentelemetry.instrumentation.anthropic import AnthropicInstrumentor as OpenLLMetry

        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(NullExporter()))
        OpenLLMetry().instrument(tracer_provider=provider)
        return Setup(_client(False), lambda: 0, _nothing, scope)
    raise ValueError(config)


def _worker(config: str, calls: int, conn: Connection) -> None:
    global CALLS
    CALLS = calls
    client, mapped, flush, scope = _setup(config)
    with scope:
        for fn in KINDS.values():
            for _ in range(100):
                fn(client)
        flush()
        # What the set-up allocated is not garbage: keep the collector from walking it in the
        # timed blocks, where it would add the same noise to every configuration.
        gc.collect()
        gc.freeze()
        conn.send("ready")
        while True:
            kind = conn.recv()
            if kind is None:
                conn.send(mapped())
                return
            conn.send(_per_call_us(KINDS[kind], client, flush))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--calls", type=int, default=CALLS)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    workers: dict[str, tuple[Any, Connection]] = {}
    for config in CONFIGS:
        ours, theirs = context.Pipe()
        process = context.Process(target=_worker, args=(config, args.calls, theirs), daemon=True)
        process.start()
        workers[config] = (process, ours)
    for _, conn in workers.values():
        assert conn.recv() == "ready"
    results: dict[str, dict[str, list[float]]] = {
        kind: {config: [] for config in MEASURED} for kind in KINDS
    }
    for round_ in range(args.rounds):
        for kind in KINDS:
            shift = round_ % len(CONFIGS)
            block: dict[str, float] = {}
            for config in CONFIGS[shift:] + CONFIGS[:shift]:
                conn = workers[config][1]
                conn.send(kind)
                block[config] = conn.recv()
            for config in MEASURED:
                results[kind][config].append(block[config] - block["bare"])
    mapped = {}
    for config, (process, conn) in workers.items():
        conn.send(None)
        mapped[config] = conn.recv()
        process.join()
    expected = args.rounds * args.calls * len(KINDS) + 100 * len(KINDS)
    for config in ("b", "b1"):
        # One event per call: a lost or merged call would make the figure meaningless.
        assert mapped[config] == expected, (config, mapped[config], expected)
    ok = True
    print(
        f"per-call overhead, CPU microseconds (instrumented minus bare, median over {args.rounds} "
        f"rounds of {args.calls}-call blocks, one process per configuration)"
    )
    print(
        f"{'':8} {'(a) SDK':>8} {'(b) +agentcap':>14} {'(c) OpenLLMetry':>16} {'b/a':>6} {'b/c':>6}"
        f"   {'(b1) per span':>14} {'b1/a':>6} {'b1/c':>6}"
    )
    for kind in KINDS:
        a, b, b1, c = (statistics.median(results[kind][k]) for k in MEASURED)
        ba, bc, b1a, b1c = (
            x / y if y > 0 else float("inf") for x, y in ((b, a), (b, c), (b1, a), (b1, c))
        )
        print(
            f"{kind:8} {a:8.0f} {b:14.0f} {c:16.0f} {ba:6.2f} {bc:6.2f}"
            f"   {b1:14.0f} {b1a:6.2f} {b1c:6.2f}"
        )
        ok = ok and ba <= 1.3 and bc <= 0.5
    print("targets (b <= 1.3 a, b <= 0.5 c):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
