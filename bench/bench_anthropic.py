"""Per-call overhead of recording anthropic model calls, over an in-process transport.

Measures, in one run, ``messages.create`` non-streamed and streamed (20 text deltas), each
instrumented minus bare (same client setup, tracing off):

  (a) the SDK's own tracing alone (SimpleSpanProcessor to a null exporter),
  (b) (a) plus otel_agentcap: AgentCapSpanProcessor stamping inside an agent, the
      AnthropicInstrumentor's causal wrapper and tool_use-id hook, and the log mapping
      (mapping.batch_from_spans) on every exported span,
  (c) OpenLLMetry's opentelemetry-instrumentation-anthropic alone (SDK tracing off).

Method: the overheads are a few hundred microseconds on calls of one to two milliseconds, on a
machine whose speed drifts. So every round times one short block of calls of each configuration
(bare, a, b, c, in an order that rotates from round to round), each configuration's overhead in a
round is its block minus that round's bare block, and the figure is the median over rounds. Time
is this process's CPU time: everything here (client, transport, span processors, exporter) runs
synchronously in this process, and CPU time is not inflated by other processes on the machine.

Targets: (b) <= 1.3 x (a) and (b) <= 0.5 x (c).  Run: .venv/bin/python bench/bench_anthropic.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import anthropic
import httpx2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import otel_agentcap as ac
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor
from otel_agentcap.mapping import batch_from_spans
from otel_agentcap.processor import AgentCapSpanProcessor

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


def _handler(request: httpx2.Request) -> httpx2.Response:
    body = json.loads(request.content)
    headers = {"request-id": "req_bench"}
    if body.get("stream"):
        return httpx2.Response(
            200, content=SSE, headers={**headers, "content-type": "text/event-stream"}
        )
    return httpx2.Response(
        200, content=JSON, headers={**headers, "content-type": "application/json"}
    )


class NullExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class MappingExporter(SpanExporter):
    """What the PostgreSQL exporter does before I/O: map spans to log records."""

    def __init__(self) -> None:
        self.events = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.events += len(batch_from_spans(spans).events)
        return SpanExportResult.SUCCESS


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


def _per_call_us(fn: Callable[[anthropic.Anthropic], None], client: anthropic.Anthropic) -> float:
    for _ in range(3):
        fn(client)
    start = time.process_time_ns()
    for _ in range(CALLS):
        fn(client)
    return (time.process_time_ns() - start) / CALLS / 1000


def main() -> int:
    global ROUNDS, CALLS
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--calls", type=int, default=CALLS)
    args = parser.parse_args()
    ROUNDS, CALLS = args.rounds, args.calls
    bare = _client(False)
    provider_a = TracerProvider()
    provider_a.add_span_processor(SimpleSpanProcessor(NullExporter()))
    client_a = _client({"tracer_provider": provider_a})
    provider_b = TracerProvider()
    provider_b.add_span_processor(AgentCapSpanProcessor())
    mapping = MappingExporter()
    provider_b.add_span_processor(SimpleSpanProcessor(mapping))
    client_b = _client({"tracer_provider": provider_b})
    provider_c = TracerProvider()
    provider_c.add_span_processor(SimpleSpanProcessor(NullExporter()))

    from opentelemetry.instrumentation.anthropic import AnthropicInstrumentor as OpenLLMetry

    def run_bare(fn: Callable[[anthropic.Anthropic], None]) -> float:
        return _per_call_us(fn, bare)

    def run_a(fn: Callable[[anthropic.Anthropic], None]) -> float:
        return _per_call_us(fn, client_a)

    def run_b(fn: Callable[[anthropic.Anthropic], None]) -> float:
        ours = AnthropicInstrumentor()
        ours.instrument()
        try:
            with ac.run("bench"), ac.agent("bench"):
                return _per_call_us(fn, client_b)
        finally:
            ours.uninstrument()

    def run_c(fn: Callable[[anthropic.Anthropic], None]) -> float:
        # Its own baseline is the bare client: an instrumentor patches the SDK classes, so the
        # bare block of the round is taken while it is not installed.
        openllmetry = OpenLLMetry()
        openllmetry.instrument(tracer_provider=provider_c)
        try:
            return _per_call_us(fn, bare)
        finally:
            openllmetry.uninstrument()

    runners = (("bare", run_bare), ("a", run_a), ("b", run_b), ("c", run_c))
    results: dict[str, dict[str, list[float]]] = {
        kind: {"a": [], "b": [], "c": []} for kind in ("create", "stream")
    }
    for round_ in range(ROUNDS):
        for kind, fn in (("create", _plain), ("stream", _streamed)):
            shift = round_ % len(runners)
            order = runners[shift:] + runners[:shift]
            block = {name: run(fn) for name, run in order}
            for name in ("a", "b", "c"):
                results[kind][name].append(block[name] - block["bare"])
    assert mapping.events > 0, "the agentcap path recorded no events"
    ok = True
    print(
        f"per-call overhead, CPU microseconds (instrumented minus bare, median over {ROUNDS} "
        f"rounds of {CALLS}-call blocks)"
    )
    print(
        f"{'':8} {'(a) SDK':>10} {'(b) +agentcap':>14} {'(c) OpenLLMetry':>16} {'b/a':>6} {'b/c':>6}"
    )
    for kind in ("create", "stream"):
        a, b, c = (statistics.median(results[kind][k]) for k in ("a", "b", "c"))
        ba = b / a if a > 0 else float("inf")
        bc = b / c if c > 0 else float("inf")
        print(f"{kind:8} {a:10.0f} {b:14.0f} {c:16.0f} {ba:6.2f} {bc:6.2f}")
        ok = ok and ba <= 1.3 and bc <= 0.5
    print("targets (b <= 1.3 a, b <= 0.5 c):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
