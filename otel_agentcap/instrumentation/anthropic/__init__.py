"""``AnthropicInstrumentor``: model calls of the ``anthropic`` SDK in the causal event log.

Usage::

    from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor

    AnthropicInstrumentor().instrument()  # or run under ``opentelemetry-instrument``

What it does depends on the installed SDK (range in :mod:`.package`):

* An SDK that traces itself (``anthropic._tracing`` exists, 1.17 and later): no span of ours. The
  SDK's ``anthropic.messages.create`` span is stamped by
  :class:`~otel_agentcap.processor.AgentCapSpanProcessor` and becomes the ``model_call`` event. The
  instrumentor wraps ``Messages.create`` / ``Messages.stream`` (sync, async, beta) to bind the
  causal parents of a request (the tool_result events of the ``tool_result`` blocks it carries),
  and adds the requested ``tool_use`` ids (``agentcap.model_call.tool_use_ids``) to the SDK's span.
  Content follows the SDK's own content mode (``ANTHROPIC_OPEN_TELEMETRY_TRACES_CONTENT_MODE``).
  The SDK's tool runners (Messages, its toolsets, Sessions) run each tool through a captured
  :class:`~otel_agentcap.Tool` (see :mod:`.tool_runner`).
* An SDK without tracing: one ``chat {model}`` CLIENT span per ``messages.create`` (sync, async,
  ``stream=True``) and ``messages.stream(...)`` call, with the SDK's attribute names, ended exactly
  once (exhausted, failed, closed, left, dropped). Content only with
  ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``.

``instrument()`` also adds an :class:`~otel_agentcap.processor.AgentCapSpanProcessor` to the global
SDK TracerProvider when it has none (for ``opentelemetry-instrument`` with
``OTEL_TRACES_EXPORTER=agentcap``). API keys and headers are never read.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Collection
from typing import Any

import wrapt
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)
from opentelemetry.instrumentation.utils import unwrap

from otel_agentcap.capture import _telemetry
from otel_agentcap.instrumentation.anthropic import patch, stream_content, tool_runner
from otel_agentcap.instrumentation.anthropic.package import _instruments
from otel_agentcap.instrumentation.anthropic.version import __version__

__all__ = ["AnthropicInstrumentor", "sdk_traces_itself"]

_logger = logging.getLogger(__name__)

# (module, class) pairs whose create/stream are wrapped, when they exist.
_RESOURCES: tuple[tuple[str, str, bool], ...] = (
    ("anthropic.resources.messages", "Messages", False),
    ("anthropic.resources.messages", "AsyncMessages", True),
    ("anthropic.resources.messages.messages", "Messages", False),
    ("anthropic.resources.messages.messages", "AsyncMessages", True),
    ("anthropic.resources.beta.messages.messages", "Messages", False),
    ("anthropic.resources.beta.messages.messages", "AsyncMessages", True),
)

# Where the SDK's tracing sets a response's attributes (imported by name in each module).
_RESPONSE_HOOKS: tuple[str, ...] = ("anthropic._tracing", "anthropic.lib._tracing._streaming")


def sdk_traces_itself() -> bool:
    """Whether the installed ``anthropic`` records its own OpenTelemetry spans."""
    try:
        return importlib.util.find_spec("anthropic._tracing") is not None
    except (ImportError, ValueError):
        return False


def ensure_agentcap_processor() -> bool:
    """Add an AgentCapSpanProcessor to the global SDK TracerProvider if it has none; returns
    whether the global provider now has one."""
    try:
        from opentelemetry.sdk.trace import TracerProvider

        from otel_agentcap.processor import AgentCapSpanProcessor

        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            return False
        active = getattr(provider, "_active_span_processor", None)
        processors = getattr(active, "_span_processors", ())
        if not any(isinstance(p, AgentCapSpanProcessor) for p in processors):
            provider.add_span_processor(AgentCapSpanProcessor())
        return True
    except Exception:
        _logger.debug("agentcap: could not add the span processor", exc_info=True)
        return False


class AnthropicInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Records ``anthropic`` model calls for otel_agentcap (see the module documentation)."""

    def __init__(self) -> None:
        super().__init__()
        self._wrapped: list[tuple[Any, str]] = []

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _wrap(self, module_name: str, cls_name: str, method: str, wrapper: Any) -> None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return
        cls = getattr(module, cls_name, None)
        if cls is None or not hasattr(cls, method):
            return
        if any(owner is cls and name == method for owner, name in self._wrapped):
            return  # re-exported under two module names
        if isinstance(cls.__dict__.get(method), wrapt.FunctionWrapper) and getattr(
            cls.__dict__[method], "_self_agentcap", False
        ):
            return
        wrapt.wrap_function_wrapper(cls, method, wrapper)
        cls.__dict__[method]._self_agentcap = True
        self._wrapped.append((cls, method))

    def _instrument(self, **kwargs: Any) -> None:
        ensure_agentcap_processor()
        _telemetry.refresh_content_capture()  # tool content follows the GenAI content switch
        self._wrap_tool_runners()
        if sdk_traces_itself():
            for module_name, cls_name, is_async in _RESOURCES:
                create = patch.causal_acreate() if is_async else patch.causal_create()
                self._wrap(module_name, cls_name, "create", create)
                self._wrap(module_name, cls_name, "stream", patch.causal_stream())
            for module_name in _RESPONSE_HOOKS:
                self._wrap_function(module_name, "set_response_attributes")
            self._wrap(
                "anthropic.lib._tracing._streaming",
                "StreamedMessage",
                "item",
                stream_content.stream_content_hook(),
            )
            return
        tracer = trace.get_tracer(
            "otel_agentcap.instrumentation.anthropic",
            __version__,
            tracer_provider=kwargs.get("tracer_provider"),
        )
        for module_name, cls_name, is_async in _RESOURCES:
            create = patch.span_acreate(tracer) if is_async else patch.span_create(tracer)
            self._wrap(module_name, cls_name, "create", create)
            self._wrap(
                module_name, cls_name, "stream", patch.span_stream(tracer, is_async=is_async)
            )

    def _wrap_tool_runners(self) -> None:
        """The SDK's tool-running paths (see :mod:`.tool_runner`)."""
        for cls_name, is_async in tool_runner.RUNNERS:
            self._wrap(
                tool_runner.RUNNER_MODULE,
                cls_name,
                "_run_tool",
                tool_runner.run_tool_wrapper(is_async=is_async),
            )
            self._wrap(
                tool_runner.RUNNER_MODULE,
                cls_name,
                "_run_toolset_member",
                tool_runner.toolset_member_wrapper(is_async=is_async),
            )
        for cls_name, is_async in tool_runner.TOOLSETS:
            self._wrap(
                tool_runner.TOOLSET_MODULE,
                cls_name,
                "tool_result",
                tool_runner.toolset_result_wrapper(is_async=is_async),
            )
        self._wrap(
            tool_runner.SESSION_RUNNER_MODULE,
            tool_runner.SESSION_RUNNER,
            "_call_tool",
            tool_runner.session_call_tool_wrapper(),
        )

    def _wrap_function(self, module_name: str, name: str) -> None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return
        if not callable(getattr(module, name, None)):
            return
        wrapt.wrap_function_wrapper(module, name, patch.tool_use_ids_hook())
        self._wrapped.append((module, name))

    def _uninstrument(self, **kwargs: Any) -> None:
        while self._wrapped:
            owner, name = self._wrapped.pop()
            try:
                unwrap(owner, name)
            except Exception:
                _logger.debug("agentcap: could not unwrap %s", name, exc_info=True)
