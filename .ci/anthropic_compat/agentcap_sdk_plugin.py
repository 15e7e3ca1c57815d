"""pytest plugin for the anthropic SDK's own test suite: every test function runs inside an
otel_agentcap run and agent scope, with ``AnthropicInstrumentor`` active.

What the harness holds constant, so that a difference in outcome can only come from the
instrumentation:

* The OpenTelemetry context. The agent scope makes its ``invoke_agent`` span current; inside it the
  harness attaches the context the test had before, so the SDK's spans have the parents they would
  have without the scope (many tracing tests assert on trace and parent ids).
* The global tracer provider. The harness registers none (a registered provider changes what the
  SDK sends, e.g. ``traceparent`` headers, and many tests check which provider is registered);
  the tests that install a provider of their own run as they would. What the instrumentation
  captures goes to the harness's own provider (AgentCapSpanProcessor and an in-memory exporter),
  which capture is pointed at directly.

Loaded with ``-p agentcap_sdk_plugin`` (this directory on ``PYTHONPATH``) by ``.ci/anthropic-compat``,
which compares the outcome of every test with a run without it.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import otel_agentcap as ac
from otel_agentcap.capture import _telemetry
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor
from otel_agentcap.pipeline.mapping import batch_from_spans
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor
from otel_agentcap.version import __version__


class _CountingExporter(SpanExporter):
    """Counts the events of the spans captured (by type), so the job can tell that capture ran."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        events = batch_from_spans(spans).events
        with self._lock:
            self.counts.update(event.event_type for event in events)
        return SpanExportResult.SUCCESS


_exporter = _CountingExporter()
_provider = TracerProvider()
_runs = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    _provider.add_span_processor(AgentCapSpanProcessor())
    _provider.add_span_processor(SimpleSpanProcessor(_exporter))
    # Capture goes to the harness's provider without registering it globally (see the module
    # documentation): the tracer capture caches once a global provider is set, set directly.
    _telemetry._real_tracer = _provider.get_tracer("otel_agentcap", __version__)  # noqa: SLF001
    AnthropicInstrumentor().instrument(tracer_provider=_provider)


def _in_agent(fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            before = otel_context.get_current()
            with ac.run(f"sdk-test-{next(_runs)}"):
                async with ac.agent("sdk-test"):
                    token = otel_context.attach(before)
                    try:
                        return await fn(*args, **kwargs)
                    finally:
                        otel_context.detach(token)

        return run_async

    @functools.wraps(fn)
    def run_sync(*args: Any, **kwargs: Any) -> Any:
        before = otel_context.get_current()
        with ac.run(f"sdk-test-{next(_runs)}"), ac.agent("sdk-test"):
            token = otel_context.attach(before)
            try:
                return fn(*args, **kwargs)
            finally:
                otel_context.detach(token)

    return run_sync


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function):
            item.obj = _in_agent(item.obj)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the events captured in this process to ``$AGENTCAP_COMPAT_REPORT/<worker>.json``."""
    report = os.environ.get("AGENTCAP_COMPAT_REPORT")
    if report:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / f"{worker}.json").write_text(json.dumps(dict(_exporter.counts)))
