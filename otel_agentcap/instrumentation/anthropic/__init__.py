"""``AnthropicInstrumentor``: model calls of the ``anthropic`` SDK in the causal event log.

Usage::

    from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor

    AnthropicInstrumentor().instrument()  # or run under ``opentelemetry-instrument``

What it does depends on the installed SDK (range in :mod:`.package`):

* An SDK that traces itself (``anthropic._tracing`` exists, 1.17 and later): no span of ours. The
  SDK's ``anthropic.messages.create`` span is stamped by
  :class:`~otel_agentcap.pipeline.processor.AgentCapSpanProcessor` and becomes the ``model_call``
  event. The instrumentor wraps ``Messages.create`` / ``.stream`` / ``.parse`` (sync, async, beta)
  to bind the causal parents of a request (the tool_result events of the ``tool_result`` blocks
  it carries), and adds the requested ``tool_use`` ids (``agentcap.model_call.tool_use_ids``) to
  the SDK's span.
  Content follows the SDK's own content mode (``ANTHROPIC_OPEN_TELEMETRY_TRACES_CONTENT_MODE``);
  the output of a raw ``messages.create(stream=True)`` that completed, which the SDK leaves off its
  span, is added as ``agentcap.model_call.output_messages`` (see :mod:`.stream_content`).
  The SDK's tool runners (Messages, its toolsets, Sessions) run each tool through a captured
  :class:`~otel_agentcap.Tool` (see :mod:`.tool_runner`): every execution the SDK makes is
  recorded; exactly-once is an opt-in (``instrument(exactly_once_tools=True)`` for all, or
  :func:`exactly_once` for one runner or toolset).
* An SDK without tracing: one ``chat {model}`` CLIENT span per ``messages.create`` (sync, async,
  ``stream=True``) and ``messages.stream(...)`` call, with the SDK's attribute names, ended exactly
  once (exhausted, failed, closed, left, dropped). Content only with
  ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``.

``instrument()`` also adds an :class:`~otel_agentcap.pipeline.processor.AgentCapSpanProcessor`
to the global SDK TracerProvider when it has none (for ``opentelemetry-instrument`` with
``OTEL_TRACES_EXPORTER=agentcap``). API keys and headers are never read.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
from collections.abc import Collection
from typing import Any, Final, NamedTuple

import wrapt
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)
from opentelemetry.instrumentation.utils import unwrap

from otel_agentcap import private_parts
from otel_agentcap.capture import _telemetry
from otel_agentcap.instrumentation.anthropic import (
    patch,
    stream_content,
    streamed_responses,
    tool_runner,
)
from otel_agentcap.instrumentation.anthropic.package import _instruments
from otel_agentcap.instrumentation.anthropic.tool_runner import (
    exactly_once,
    set_exactly_once_default,
)
from otel_agentcap.instrumentation.anthropic.version import __version__

__all__ = [
    "AnthropicInstrumentor",
    "exactly_once",
    "sdk_traces_itself",
    "set_exactly_once_default",
]

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


class _PrivateHook(NamedTuple):
    """A private part of the anthropic SDK that a wrapper hooks into: the release it is tested
    since (it may be older) and what is lost without it."""

    since: str
    lost: str

    def missing(self, part: str) -> None:
        """Warn once when the installed SDK is at or above :attr:`since` and has no ``part``
        (below it, the SDK has no such path to capture)."""
        installed = _release(private_parts.installed_version("anthropic"))
        if installed is not None and installed >= (_release(self.since) or ()):
            private_parts.missing("anthropic", part, self.lost)


def _release(version: str) -> tuple[int, ...] | None:
    """The release numbers of ``version`` (``"2.15.0rc1"`` -> ``(2, 15, 0)``), or None."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else None


# Beware: private hooks of the anthropic SDK. They are the one place each path passes through,
# and the SDK offers no public hook for any of them. The releases named are the oldest each one is
# tested at; the newest is the one a fresh install gets (2.15 when written). Missing, the path
# runs as the SDK runs it, uncaptured, with one warning.
#: ``set_response_attributes(span, span_name, data)`` of the SDK's tracing, where its spans get a
#: response's attributes: in ``anthropic._tracing`` (and imported by name into the streaming
#: module) from 2.6.0, tested at 2.6.0 and 2.15. The releases that trace themselves before it
#: (1.17 to 2.5) record responses elsewhere, in another shape, not hooked: warned about from 1.17.
_RESPONSE_HOOK: Final = _PrivateHook(
    "1.17.0", "model_call events do not list the tool_use ids a response asked for"
)
#: ``StreamedMessage.item`` and ``.end`` of the SDK's stream recorder, where a stream's events pass
#: and where its span is ended (see :mod:`.stream_content`).
_STREAM_CONTENT_HOOK: Final = _PrivateHook(
    "2.14.0", "a raw messages.create(stream=True) read to the end records no output with content on"
)
#: ``finish_api_call_span`` where ``anthropic._base_client`` imports it, with the tracing functions
#: it reaches (see :mod:`.streamed_responses`): tested at 2.16.
_UNREAD_RESPONSE_HOOK: Final = _PrivateHook(
    "2.16.0", "a messages.create read through with_streaming_response records no response"
)
#: ``_run_tool`` / ``_run_toolset_member`` of the Messages tool runners.
_RUNNER_HOOK: Final = _PrivateHook(
    "2.14.0", "tools run by client.beta.messages.tool_runner(...) are not captured"
)
#: ``_call_tool`` of ``SessionRun`` (anthropic 2.16 and later) or ``SessionToolRunner``.
_SESSION_HOOK: Final = _PrivateHook(
    "2.14.0", "tools run by client.beta.sessions.events.tool_runner(...) are not captured"
)


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

        from otel_agentcap.pipeline.processor import AgentCapSpanProcessor, has_agentcap_processor

        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            return False
        if not has_agentcap_processor(provider):
            provider.add_span_processor(AgentCapSpanProcessor())
        return True
    except Exception:
        _logger.debug("agentcap: could not add the span processor", exc_info=True)
        return False


class AnthropicInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Records ``anthropic`` model calls for otel_agentcap (see the module documentation)."""

    def __init__(self) -> None:
        super().__init__()
        # The base class makes the instrumentor one instance, and Python runs __init__ again for
        # every AnthropicInstrumentor() call: what an earlier handle wrapped must stay listed,
        # or uninstrument() finds nothing to unwrap.
        if not hasattr(self, "_wrapped"):
            self._wrapped: list[tuple[Any, str]] = []

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def instrument(self, **kwargs: Any) -> None:
        """Instrument the SDK; a second call is a no-op without the base class's warning, since
        ``configure()`` instruments already and code written before it did calls this too."""
        if self.is_instrumented_by_opentelemetry:
            return
        super().instrument(**kwargs)

    def _wrap(
        self,
        module_name: str,
        cls_name: str,
        method: str,
        wrapper: Any,
        private: _PrivateHook | None = None,
    ) -> None:
        """Wrap ``module_name.cls_name.method`` when the SDK has it. A ``private`` hook missing
        from an SDK release at or above the one it is tested since is warned about once."""
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        cls = getattr(module, cls_name, None)
        if cls is None or not hasattr(cls, method):
            if private is not None:
                private.missing(f"{module_name}.{cls_name}.{method}")
            return
        if any(owner is cls and name == method for owner, name in self._wrapped):
            return  # re-exported under two module names
        if isinstance(cls.__dict__.get(method), wrapt.FunctionWrapper) and getattr(
            cls.__dict__[method], "_self_agentcap", False
        ):
            return
        wrapt.wrap_function_wrapper(cls, method, wrapper)
        # wrapt keeps attributes named _self_* on the wrapper: this one marks the wrapper as ours.
        cls.__dict__[method]._self_agentcap = True  # noqa: SLF001 (see above)
        self._wrapped.append((cls, method))

    def _instrument(self, **kwargs: Any) -> None:
        if "exactly_once_tools" in kwargs:
            set_exactly_once_default(bool(kwargs["exactly_once_tools"]))
        ensure_agentcap_processor()
        _telemetry.refresh_content_capture()  # tool content follows the GenAI content switch
        self._wrap_tool_runners()
        if sdk_traces_itself():
            for module_name, cls_name, is_async in _RESOURCES:
                create = patch.causal_acreate() if is_async else patch.causal_create()
                self._wrap(module_name, cls_name, "create", create)
                # parse (structured outputs) sends its request itself, not through create.
                self._wrap(module_name, cls_name, "parse", create)
                self._wrap(module_name, cls_name, "stream", patch.causal_stream(is_async=is_async))
            for module_name in _RESPONSE_HOOKS:
                self._wrap_function(
                    module_name,
                    "set_response_attributes",
                    _RESPONSE_HOOK,
                    patch.tool_use_ids_hook(),
                    "tracing hook set_response_attributes",  # one warning for both modules
                )
            self._wrap_function(
                streamed_responses.CALLER_MODULE,
                streamed_responses.FUNCTION,
                _UNREAD_RESPONSE_HOOK,
                streamed_responses.finish_hook(),
                f"{streamed_responses.CALLER_MODULE}.{streamed_responses.FUNCTION}",
            )
            for method, hook in (
                ("item", stream_content.item_hook()),
                ("end", stream_content.end_hook()),
            ):
                self._wrap(
                    "anthropic.lib._tracing._streaming",
                    "StreamedMessage",
                    method,
                    hook,
                    _STREAM_CONTENT_HOOK,
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
                _RUNNER_HOOK,
            )
            self._wrap(
                tool_runner.RUNNER_MODULE,
                cls_name,
                "_run_toolset_member",
                tool_runner.toolset_member_wrapper(is_async=is_async),
                _RUNNER_HOOK,
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
            tool_runner.session_runner_class(),
            "_call_tool",
            tool_runner.session_call_tool_wrapper(),
            _SESSION_HOOK,
        )

    def _wrap_function(
        self, module_name: str, name: str, private: _PrivateHook, wrapper: Any, part: str
    ) -> None:
        """Wrap the function ``module_name.name`` with ``wrapper`` when the SDK has it; else
        warn once about ``part`` (from the release ``private`` is tested since)."""
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if not callable(getattr(module, name, None)):
            private.missing(part)
            return
        wrapt.wrap_function_wrapper(module, name, wrapper)
        self._wrapped.append((module, name))

    def _uninstrument(self, **kwargs: Any) -> None:
        while self._wrapped:
            owner, name = self._wrapped.pop()
            try:
                unwrap(owner, name)
            except Exception:
                _logger.debug("agentcap: could not unwrap %s", name, exc_info=True)
