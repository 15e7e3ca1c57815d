"""Instrumentations of model-provider SDKs (see :mod:`otel_agentcap.instrumentation.anthropic`)."""

from __future__ import annotations

import importlib.util
import logging

_logger = logging.getLogger(__name__)


def instrument_installed() -> list[str]:
    """Instrument the installed libraries that need it for a full record, and return their names.

    Today that is the ``anthropic`` SDK: :class:`~.anthropic.AnthropicInstrumentor` names the
    tool results a request sends back as the causal parents of its model call (the tool -> model
    edge), adds the requested ``tool_use`` ids to the SDK's spans, captures the SDK's tool runners,
    and records the spans itself on SDKs that do not trace themselves. A library that is not
    installed is skipped, one already instrumented is left as it is. Never raises: a failure is
    logged and the program runs uninstrumented.
    """
    instrumented: list[str] = []
    try:
        if importlib.util.find_spec("anthropic") is None:
            return instrumented
        from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor

        AnthropicInstrumentor().instrument()
        instrumented.append("anthropic")
    except Exception:
        _logger.warning("agentcap: could not instrument the anthropic SDK", exc_info=True)
    return instrumented
