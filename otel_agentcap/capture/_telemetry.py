"""Span helpers shared by the capture modules. Needs only ``opentelemetry-api``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe, private_parts
from otel_agentcap.pipeline.span_attributes import add_attributes
from otel_agentcap.pipeline.stamping import Stamp
from otel_agentcap.version import __version__

_logger = logging.getLogger("otel_agentcap")

tracer = trace.get_tracer("otel_agentcap", __version__)
# The tracer of the global provider once one is set (it is set once per process). Until then
# ``tracer`` is the API's ProxyTracer, which forwards every call through a property and *args:
# capture, usually imported before the provider is configured, would pay that on every span.
_real_tracer: Tracer | None = None


def _resolved_tracer() -> Tracer:
    global _real_tracer
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return tracer  # no global provider yet: the proxy resolves it later
    _real_tracer = trace.get_tracer("otel_agentcap", __version__)
    return _real_tracer


def _current_context_var() -> tuple[ContextVar[Context] | None, str]:
    """The ContextVar that holds OpenTelemetry's current context and the key of the current span
    in it, when the runtime context is the API's default (contextvars), else ``(None, "")``.

    A tool call makes its span current by setting that variable to a copy of the current context
    with its span, what ``attach(set_span_in_context(span))`` does through four calls (3,400 of the
    8,400 instructions of attaching and detaching). Beware: private parts of opentelemetry-api
    (``context._RUNTIME_CONTEXT``, ``ContextVarsRuntimeContext._current_context``,
    ``trace.propagation._SPAN_KEY``), tested with 1.45. Missing: one warning, and the public
    functions are used (slower, same result). Another runtime context (``OTEL_PYTHON_CONTEXT``)
    is always used through the public functions."""
    runtime: Any = None
    span_key: Any = None
    try:
        from opentelemetry.context import _RUNTIME_CONTEXT as runtime
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
        from opentelemetry.trace.propagation import _SPAN_KEY as span_key
    except ImportError:
        pass
    else:
        if type(runtime) is not ContextVarsRuntimeContext:
            return None, ""
    var = getattr(runtime, "_current_context", None)
    if not isinstance(var, ContextVar) or type(span_key) is not str:
        private_parts.missing(
            "opentelemetry-api",
            "context._RUNTIME_CONTEXT._current_context or trace.propagation._SPAN_KEY",
            "a tool call's span is made current through the public API (slower)",
        )
        return None, ""
    return var, span_key


#: See _current_context_var (None: use the public API).
context_var, SPAN_KEY = _current_context_var()

_escape = json.encoder.encode_basestring_ascii
json_ascii = _escape
"""A str as a JSON string with every non-ASCII character escaped (how ``outcome_record`` writes the
idempotency key)."""
json_string = json.encoder.encode_basestring
"""A str as a JSON string, as ``jsonsafe.dumps`` writes it (for ids, which are valid UTF-8 without
NUL; see ``model.validate_id``)."""


def run_attributes_json(attributes: Mapping[str, Any]) -> str:
    """A run's attributes (``run(**attributes)``) as JSON text, ``jsonsafe.dumps``. Over the
    payload size limit, each value is bounded on its own (a truncation marker in its place), so
    the other attributes stay readable, as a tool's payload keeps its tool name."""
    text = jsonsafe.dumps(attributes)
    if not text.startswith('{"$agentcap.truncated"'):
        return text
    keys = [str(key) for key in attributes]
    if any(
        "\x00" in key or key.startswith(jsonsafe.MARKER_PREFIX) or not _utf8(key) for key in keys
    ):
        return text  # keys only the whole object's encoding can hold: bounded as a whole
    fields = (
        f"{json_string(key)}:{jsonsafe.dumps(value)}"
        for key, value in zip(keys, attributes.values(), strict=True)
    )
    return "{" + ",".join(fields) + "}"


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Encoded(str):
    """A payload already serialised with ``jsonsafe.dumps``."""

    __slots__ = ()


CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def _content_capture_from_env() -> bool:
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in ("1", "true", "yes")


class _ContentCapture:
    """Whether content goes on the GenAI attributes of agentcap's own spans (tool arguments and
    results as ``gen_ai.tool.call.arguments`` / ``.result``). Read from the environment when this
    module is imported and again by :func:`refresh_content_capture` (``configure()`` and the
    Anthropic instrumentor call it), not on every tool call."""

    __slots__ = ("enabled",)

    def __init__(self) -> None:
        self.enabled = _content_capture_from_env()


content = _ContentCapture()


def refresh_content_capture(enabled: bool | None = None) -> bool:
    """Set content capture (``None``: from ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``);
    returns the new setting."""
    content.enabled = _content_capture_from_env() if enabled is None else enabled
    return content.enabled


def tool_payload(head: str, field: str, value: Any) -> str:
    """The payload ``{"tool": ..., "invocation_id": ..., field: value}`` of a tool event, given
    ``head``, its encoded beginning up to the invocation id. Only ``value`` is encoded here, with
    ``jsonsafe.dumps``, so a value over the size limit becomes a truncation marker under ``field``
    while the tool and invocation id stay readable."""
    return f'{head},"{field}":{jsonsafe.dumps(value)}}}'


def event_attributes(
    stamp: Stamp, payload: Any, extra: dict[str, AttributeValue] | None = None
) -> dict[str, AttributeValue]:
    attributes = stamp.attributes()
    attributes[attr.EVENT_PAYLOAD] = (
        str(payload) if isinstance(payload, Encoded) else jsonsafe.dumps(payload)
    )
    if extra is not None:
        attributes.update(extra)
    return attributes


def start_span(
    name: str,
    attributes: dict[str, AttributeValue],
    links: Sequence[Link] = (),
    kind: SpanKind = SpanKind.INTERNAL,
    context: Context | None = None,
    start_time: int | None = None,
) -> Span:
    """Start a span with ``attributes`` (stamps and payload included), a child of the current
    span or of the span in ``context``. Never raises."""
    try:
        return (_real_tracer or _resolved_tracer()).start_span(
            name, context, kind, attributes, links, start_time
        )
    except Exception:
        _logger.exception("agentcap: could not start span %s", name)
        return trace.INVALID_SPAN


def stamp_span(
    span: Span, stamp: Stamp, payload: Any, extra: dict[str, AttributeValue] | None = None
) -> None:
    """Put the event ``stamp`` (and its payload) on a running ``span`` that was started without
    it (when whether it records the event was decided after it started). Never raises."""
    try:
        add_attributes(span, event_attributes(stamp, payload, extra))
    except Exception:
        _logger.exception("agentcap: could not record %s", stamp.event_type)


def start_event_span(
    name: str,
    stamp: Stamp,
    payload: Any,
    extra: dict[str, AttributeValue] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    context: Context | None = None,
) -> Span:
    """Start a span whose primary event is ``stamp``, linked to the spans of its causal parents.
    Never raises."""
    return start_span(name, event_attributes(stamp, payload, extra), stamp.links, kind, context)


def outcome_record(stamp: Stamp, payload: Any) -> str:
    """The closing event ``stamp`` of an operation as the JSON record of ``attributes.OUTCOME``.

    Built by hand: event and parent ids are UUID strings and the type is ours, so only the key
    needs escaping; the payload is encoded once, here (unless it is ``Encoded`` already), and
    embedded."""
    parents = '","'.join(stamp.causal_parent_ids)
    return (
        f'{{"id":"{stamp.event_id}","type":"{stamp.event_type}","seq":{stamp.seq},'
        f'"key":{_escape(stamp.idempotency_key)},'
        f'"parents":{f"""["{parents}"]""" if parents else "[]"},'
        f'"payload":{payload if isinstance(payload, Encoded) else jsonsafe.dumps(payload)}}}'
    )


def finish_span(
    span: Span,
    stamp: Stamp,
    payload: Any,
    error: BaseException | None = None,
    extra: dict[str, AttributeValue] | None = None,
) -> None:
    """End ``span`` with its closing event ``stamp`` (see ``attributes.OUTCOME``), linked to the
    spans of its causal parents other than ``span`` itself. Never raises."""
    try:
        attributes: dict[str, AttributeValue] = {attr.OUTCOME: outcome_record(stamp, payload)}
        if extra:
            attributes.update(extra)
        add_attributes(span, attributes)
        if stamp.links:
            add_links(span, stamp.links)
    except Exception:
        _logger.exception("agentcap: could not record %s", stamp.event_type)
    end_span(span, error)


def add_links(span: Span, links: Sequence[Link]) -> None:
    """Add ``links`` to the running ``span``, except links to itself and links to parent events
    it links to already (those of its start event), up to ``attributes.MAX_CAUSAL_LINKS`` in all."""
    own = span.get_span_context().span_id
    existing = getattr(span, "links", ())
    known = {(link.attributes or {}).get(attr.LINK_EVENT_ID) for link in existing}
    room = attr.MAX_CAUSAL_LINKS - len(existing)
    for link in links:
        event_id = (link.attributes or {}).get(attr.LINK_EVENT_ID)
        if link.context.span_id == own or event_id in known or room <= 0:
            continue
        known.add(event_id)
        room -= 1
        span.add_link(link.context, link.attributes)


def error_type(error: BaseException) -> str:
    """The qualified type name of ``error``, without ``builtins.``."""
    cls = type(error)
    module = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
    return f"{module}{cls.__qualname__}"


def error_payload(error: BaseException, **fields: Any) -> dict[str, Any]:
    return {
        "error_type": error_type(error),
        "message": _safe_str(error),
        **fields,
    }


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)[:4000]
    except Exception:
        return f"<{type(error).__name__}>"


def end_span(span: Span, error: BaseException | None = None) -> None:
    """End ``span``, recording ``error`` on it first. Never raises, and always ends the span: an
    error that cannot be recorded (a ``__str__`` that raises, say) must not cost the span's events.
    """
    if error is not None:
        try:
            span.set_attribute(attr.ERROR_TYPE, type(error).__qualname__)
            span.set_status(trace.Status(trace.StatusCode.ERROR, _safe_str(error)[:200]))
        except Exception:
            _logger.exception("agentcap: could not record the error status")
        try:
            span.record_exception(error)
        except Exception:
            # The SDK formats the exception with str(); record what we can instead.
            try:
                span.add_event(
                    "exception",
                    {
                        "exception.type": error_type(error),
                        "exception.message": _safe_str(error),
                    },
                )
            except Exception:
                _logger.debug("agentcap: could not record the exception", exc_info=True)
    try:
        span.end()
    except Exception:
        _logger.exception("agentcap: could not end span")
