"""``AnthropicInstrumentor`` is one instance (the OpenTelemetry base class makes it a singleton):
whichever handle instruments or uninstruments, ``uninstrument()`` restores every part of the SDK
it wrapped."""

from __future__ import annotations

from typing import Any

import anthropic
import anthropic._base_client
import pytest
from anthropic.lib.tools._beta_runner import BaseAsyncToolRunner, BaseSyncToolRunner
from anthropic.resources.messages import AsyncMessages, Messages

from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor, sdk_traces_itself

pytestmark = pytest.mark.skipif(
    not sdk_traces_itself(), reason="the installed anthropic (before 1.17) does not trace itself"
)


def _parts() -> dict[str, Any]:
    """What the instrumentor wraps, as the SDK's classes and modules hold it now."""
    return {
        "Messages.create": Messages.__dict__["create"],
        "AsyncMessages.stream": AsyncMessages.__dict__["stream"],
        "BaseSyncToolRunner._run_tool": BaseSyncToolRunner.__dict__["_run_tool"],
        "BaseAsyncToolRunner._run_tool": BaseAsyncToolRunner.__dict__["_run_tool"],
        "set_response_attributes": anthropic._tracing.set_response_attributes,
        "finish_api_call_span": getattr(anthropic._base_client, "finish_api_call_span", None),
    }


def _same(parts: dict[str, Any], originals: dict[str, Any]) -> bool:
    """Whether every part is the very object it was (a wrapt proxy compares equal to what it
    wraps, so ``==`` cannot tell)."""
    return all(parts[name] is original for name, original in originals.items())


def test_uninstrument_through_another_handle_restores_the_sdk() -> None:
    """instrument(), then AnthropicInstrumentor().uninstrument() on a new handle, unwraps all."""
    originals = _parts()
    AnthropicInstrumentor().instrument()
    try:
        wrapped = _parts()
        assert wrapped["Messages.create"] is not originals["Messages.create"]
        handle = AnthropicInstrumentor()
        handle.uninstrument()
        assert _same(_parts(), originals)
    finally:
        if AnthropicInstrumentor().is_instrumented_by_opentelemetry:
            AnthropicInstrumentor().uninstrument()


def test_instrument_through_another_handle_then_uninstrument_restores_the_sdk() -> None:
    """A second handle's instrument() (a no-op) keeps what the first wrapped to unwrap."""
    originals = _parts()
    first = AnthropicInstrumentor()
    first.instrument()
    try:
        AnthropicInstrumentor().instrument()
        first.uninstrument()
        assert _same(_parts(), originals)
    finally:
        if AnthropicInstrumentor().is_instrumented_by_opentelemetry:
            AnthropicInstrumentor().uninstrument()
