"""``AgentCapSpanProcessor``: stamps agent identity, Lamport sequence and causal parents on spans.

Spans created by otel_agentcap's capture API already carry their stamps (set as start attributes,
because the capture code needs the sequence itself, e.g. to chain memory writes; a tool's
``execute_tool`` span starts with its event id only, which is what this processor looks for, and
gets the rest of its stamp right after). This processor stamps everything else that starts inside
an agent:

* every span gets ``agentcap.run.id``, ``agentcap.agent.id`` and ``gen_ai.agent.id``/``name``;
* spans that are captured operations of their own, such as model-call spans of the anthropic SDK
  or of a GenAI instrumentation (``gen_ai.operation.name`` = ``chat``), also get a sequence, an
  event id and the causal parents bound with :func:`~otel_agentcap.caused_by`, and become
  ``model_call`` events.

Spans started outside any agent pass through untouched, and so do spans started on behalf of an
execution that has already failed or timed out (an abandoned worker thread or task): nothing is
recorded for an execution after its ``agent_error``. Stamps are written in ``on_start``, where
the span is still mutable, on the thread that starts it; ``on_start`` never raises.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap import private_parts
from otel_agentcap.context import AgentContext, current_agent
from otel_agentcap.forks import renew_locks_after_fork
from otel_agentcap.model import EventRef, EventType
from otel_agentcap.pipeline import causal_links
from otel_agentcap.pipeline.call_identity import SUPERSEDED, replaces
from otel_agentcap.pipeline.model_calls import STOP_REASON, TOOL_USE_IDS, is_sdk_scope
from otel_agentcap.pipeline.span_attributes import add_attributes, attributes_of
from otel_agentcap.pipeline.stamping import stamp

_logger = logging.getLogger(__name__)

#: Returns the event type a foreign span records (or None for "not an event of its own").
SpanClassifier = Callable[[str, Mapping[str, AttributeValue], str | None], str | None]

MODEL_OPERATIONS: Final = frozenset({"chat", "text_completion", "generate_content"})
_MODEL_CALL: Final = EventType.MODEL_CALL.value
#: Open add-on model-call spans kept per thread and task, waiting for the SDK's span of their call.
_MAX_OPEN_PER_TASK: Final = 16
#: Stop reasons of responses that hold no tool_use block (the API stops with ``tool_use`` when the
#: model asks for a tool).
_NO_TOOL_REQUEST: Final = frozenset({"end_turn", "stop_sequence"})


def classify_genai_span(
    name: str, attributes: Mapping[str, AttributeValue], scope: str | None
) -> str | None:
    """Model calls by the GenAI conventions: ``gen_ai.operation.name`` is a model operation."""
    if attributes.get(attr.GEN_AI_OPERATION_NAME) in MODEL_OPERATIONS:
        return _MODEL_CALL
    return None


def _task_key() -> tuple[int, int]:
    """The thread and asyncio task a span starts in: spans of one call start in one of each."""
    # _get_running_loop returns None outside a loop, where get_running_loop() and current_task()
    # raise: the cheap way on every span. Standard library, in every CPython this package admits.
    loop = asyncio._get_running_loop()  # noqa: SLF001 (see above)
    task = asyncio.current_task(loop) if loop is not None else None
    return threading.get_ident(), id(task) if task is not None else 0


def span_processors_of(provider: TracerProvider) -> tuple[SpanProcessor, ...] | None:
    """The span processors added to ``provider``, or None when they cannot be read.

    Beware: the SDK's ``TracerProvider`` has no public list of its processors; they sit in
    ``_active_span_processor._span_processors`` (opentelemetry-sdk 1.34 to 1.45 tested). Missing:
    one warning and None; callers add an ``AgentCapSpanProcessor`` then, which is harmless when
    there is one already (a stamped span is not stamped again).
    """
    try:
        active = provider._active_span_processor  # noqa: SLF001 (see above)
        processors = tuple(active._span_processors)  # noqa: SLF001 (see above)
    except (AttributeError, TypeError):
        private_parts.missing(
            "opentelemetry-sdk",
            "TracerProvider._active_span_processor._span_processors",
            "an AgentCapSpanProcessor is added without checking for one",
        )
        return None
    return processors


def has_agentcap_processor(provider: TracerProvider) -> bool:
    """Whether ``provider`` has an :class:`AgentCapSpanProcessor` (False when unknown)."""
    processors = span_processors_of(provider)
    return processors is not None and any(isinstance(p, AgentCapSpanProcessor) for p in processors)


class _OpenModelCall:
    """A model-call span of an add-on instrumentation, open and not yet matched with the SDK's."""

    __slots__ = ("parent_span_id", "span", "span_id")

    def __init__(self, span: Span, parent_span_id: int) -> None:
        self.span = span
        self.span_id = span.get_span_context().span_id
        self.parent_span_id = parent_span_id


class AgentCapSpanProcessor(SpanProcessor):
    """Stamps spans started inside an agent. Add it to the TracerProvider before any exporting
    processor, so exporters see the stamps.

    One model call is one event, however many instrumentations record it
    (:mod:`otel_agentcap.pipeline.call_identity`). Of two model-call spans of the same call (one
    started while the other is current, or an add-on's span that is not made current followed,
    in the same thread or task and under the same parent, by the SDK's own span), one keeps the
    event and the other is marked ``agentcap.event.superseded`` while it is still running, so the
    mapping skips it: the SDK's span wins, else the inner one. Both carry the same stamp, so the
    log holds one event whichever is exported.
    """

    def __init__(self, classifiers: tuple[SpanClassifier, ...] = (classify_genai_span,)) -> None:
        self._classifiers = classifiers
        self._open_lock = threading.Lock()
        renew_locks_after_fork(self, "_open_lock")
        self._open: dict[tuple[int, int], list[_OpenModelCall]] = {}

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        try:
            # The first test of _stamp, inlined: a capture-API span (every captured tool call's)
            # is stamped already.
            # Plain attribute reads: getattr() with a default costs several times as much.
            try:
                inner = span._attributes._dict  # type: ignore[union-attr]  # noqa: SLF001
            except AttributeError:
                inner = None
            if type(inner) is dict and (attr.EVENT_ID in inner or attr.RUN_ROOT in inner):
                return
            self._stamp(span, parent_context)
        except Exception:
            _logger.exception("agentcap: could not stamp span %s", getattr(span, "name", "?"))

    def _stamp(self, span: Span, parent_context: Context | None = None) -> None:
        attributes = attributes_of(span)
        if attr.EVENT_ID in attributes or attr.RUN_ROOT in attributes:
            return  # a capture-API span (an event's, or a run's root), stamped when created
        ctx = current_agent()
        if ctx is None or ctx.is_cancelled():
            return
        instrumentation_scope = span.instrumentation_scope
        scope = instrumentation_scope.name if instrumentation_scope is not None else None
        event_type = None
        for classify in self._classifiers:
            event_type = classify(span.name, attributes, scope)
            if event_type is not None:
                break
        if event_type is None:
            add_attributes(
                span,
                {
                    attr.RUN_ID: ctx.run_id,
                    attr.AGENT_ID: ctx.agent_id,
                    attr.GEN_AI_AGENT_ID: ctx.agent_id,
                    attr.GEN_AI_AGENT_NAME: ctx.name,
                },
            )
            return
        if event_type == _MODEL_CALL and self._join_model_call(span, ctx, scope, parent_context):
            return
        event = stamp(ctx, event_type)
        add_attributes(span, event.attributes())
        for link in event.links:  # the spans of its causal parents (tool results, say)
            span.add_link(link.context, link.attributes)
        if event_type == _MODEL_CALL and not is_sdk_scope(scope):
            parent = trace.get_current_span(parent_context)
            with self._open_lock:
                if len(self._open) > 10_000:
                    self._open.clear()
                entries = self._open.setdefault(_task_key(), [])
                entries.append(_OpenModelCall(span, parent.get_span_context().span_id))
                if len(entries) > _MAX_OPEN_PER_TASK:
                    # Spans no SDK span will join (SDK tracing off) and that never end.
                    del entries[0]

    def _join_model_call(
        self, span: Span, ctx: AgentContext, scope: str | None, parent_context: Context | None
    ) -> bool:
        """Give ``span`` the stamp of another span of the same model call, if there is one, and
        mark whichever of the two loses as superseded. Returns whether it did."""
        sdk = is_sdk_scope(scope)
        if sdk and not self._open:
            # Every open add-on model-call span that holds an event is in _open, and only such a
            # span can hold the SDK's call (the SDK's own spans do not nest): nothing to join.
            return False
        parent = trace.get_current_span(parent_context)
        other: Span | None = None
        if (
            isinstance(parent, Span)
            and parent.is_recording()
            and attributes_of(parent).get(attr.EVENT_TYPE) == _MODEL_CALL
        ):
            other = parent
        elif sdk and self._open:
            key = _task_key()
            parent_id = parent.get_span_context().span_id
            with self._open_lock:
                entries = self._open.get(key, [])
                candidates = [
                    entry
                    for entry in entries
                    if entry.parent_span_id == parent_id and entry.span.is_recording()
                ]
                # Two open add-on spans here (two stream managers created before either was
                # entered, say) could be either call: joining the wrong one would give one
                # call the other's stamp, so none is joined, and the log matches the records
                # by response and request id instead.
                if len(candidates) == 1:
                    entries.remove(candidates[0])
                    if not entries:
                        del self._open[key]
                    other = candidates[0].span
        if other is None:
            return False
        theirs = dict(attributes_of(other))  # a copy: the other span may be changing
        if theirs.get(attr.AGENT_ID) != ctx.agent_id or theirs.get(attr.RUN_ID) != ctx.run_id:
            return False
        if theirs.get(SUPERSEDED):
            return False
        copied = {key: value for key, value in theirs.items() if key.startswith("agentcap.")}
        copied[attr.GEN_AI_AGENT_ID] = ctx.agent_id
        copied[attr.GEN_AI_AGENT_NAME] = ctx.name
        other_scope = other.instrumentation_scope.name if other.instrumentation_scope else None
        add_attributes(span, copied)
        for link in other.links:
            if link.attributes and attr.LINK_EVENT_ID in link.attributes:
                span.add_link(link.context, dict(link.attributes))
        other_sdk = is_sdk_scope(other_scope)
        if replaces(sdk, other_sdk) or (other is parent and not other_sdk):
            # The SDK's span wins; of two other spans, the inner one (the outer one wraps it).
            other.set_attribute(SUPERSEDED, True)
        else:
            span.set_attribute(SUPERSEDED, True)
        return True

    def on_end(self, span: ReadableSpan) -> None:
        try:
            # The first test of _remember, inlined: only model calls are indexed.
            try:
                inner = span._attributes._dict  # type: ignore[union-attr]  # noqa: SLF001
            except AttributeError:
                inner = None
            if type(inner) is dict and inner.get(attr.EVENT_TYPE) != _MODEL_CALL:
                return
            self._remember(span)
        except Exception:
            _logger.exception("agentcap: could not index span %s", getattr(span, "name", "?"))

    def _remember(self, span: ReadableSpan) -> None:
        """Index a finished model call by its response id and the tool_use ids it asked for, so
        tool runs can name it as their causal parent."""
        attributes = attributes_of(span)
        if attributes.get(attr.EVENT_TYPE) != _MODEL_CALL:
            return
        if self._open:
            span_id = span.context.span_id
            with self._open_lock:
                for key, entries in list(self._open.items()):
                    for entry in entries:
                        if entry.span_id == span_id:
                            entries.remove(entry)
                            if not entries:
                                del self._open[key]
                            break
        if attributes.get(SUPERSEDED):
            return
        tool_use_ids = attributes.get(TOOL_USE_IDS)
        if not tool_use_ids and attributes.get(STOP_REASON) in _NO_TOOL_REQUEST:
            return  # the response asked for no tool: no tool run will look for it
        response_id = attributes.get(attr.GEN_AI_RESPONSE_ID)
        if type(response_id) is not str and not tool_use_ids:
            return  # nothing a tool run could look it up by
        event_id = attributes.get(attr.EVENT_ID)
        seq = attributes.get(attr.EVENT_SEQ)
        run_id = attributes.get(attr.RUN_ID)
        if type(event_id) is not str or type(seq) is not int or type(run_id) is not str:
            return
        causal_links.record_model_call(
            run_id,
            EventRef(event_id, seq, str(attributes.get(attr.AGENT_ID, "")), span.context),
            response_id=response_id if type(response_id) is str else None,
            tool_use_ids=[str(i) for i in tool_use_ids]
            if isinstance(tool_use_ids, tuple | list)
            else (),
        )

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
