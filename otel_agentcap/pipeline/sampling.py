"""``RecordEverySpan``: sampling for a provider that feeds the event log.

An event log cannot be sampled: a run with one tool result in ten is not a record of the run. But
trace backends often are (``OTEL_TRACES_SAMPLER=parentbased_traceidratio``, say), and the same
provider feeds both. ``RecordEverySpan`` wraps the sampler that would otherwise decide: what it
samples stays sampled (exported by the SDK's processors, to a collector); what it drops is
recorded without being sampled (``RECORD_ONLY``): the SDK's exporting processors skip it, as they
skip every span not sampled, while agentcap's processors store it. Propagated trace context keeps
the inner sampler's decision (the sampled flag), so other services sample as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, TraceFlags
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes


class RecordEverySpan(Sampler):
    """Samples as ``inner`` does, and records what ``inner`` drops (see the module doc)."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        result = self.inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )
        if result.decision is Decision.DROP:
            # A dropping sampler returns no attributes; the span is made with those it returns.
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"RecordEverySpan{{{self.inner.get_description()}}}"


def configured_sampler() -> Sampler:
    """The sampler the SDK would use for a new ``TracerProvider`` (``OTEL_TRACES_SAMPLER`` and
    ``OTEL_TRACES_SAMPLER_ARG``, else parent-based always-on), wrapped in ``RecordEverySpan``."""
    # A provider made only to read its sampler (the SDK's own choice from the environment); an
    # empty resource, so no resource detector runs for it.
    sampler = TracerProvider(resource=Resource.get_empty(), shutdown_on_exit=False).sampler
    return sampler if isinstance(sampler, RecordEverySpan) else RecordEverySpan(sampler)


_EMPTY = Context()


def stored_trace_flags(trace_id: int) -> TraceFlags:
    """The flags of a span of trace ``trace_id`` rebuilt from the event log (the run's root span
    or a spawn's, in a process that resumes a run or finds a stored spawn), whose sampled flag
    the log does not keep: what the global provider's sampler decides for a root span of that
    trace. That is the decision the run's first process took for its root span when it has the
    same sampler (``parentbased_always_off`` drops it, ``parentbased_traceidratio`` decides by the
    trace id), so a parent-based sampler here samples the rest of the run as it was sampled
    there. Sampled when there is no SDK provider or its sampler fails."""
    sampler = getattr(trace.get_tracer_provider(), "sampler", None)
    if isinstance(sampler, Sampler):
        try:
            # An empty context, not the current one: a parent-based sampler asks its root sampler.
            result = sampler.should_sample(_EMPTY, trace_id, "invoke_workflow")
        except Exception:
            return TraceFlags(TraceFlags.SAMPLED)
        if result.decision is not Decision.RECORD_AND_SAMPLE:
            return TraceFlags(TraceFlags.DEFAULT)
    return TraceFlags(TraceFlags.SAMPLED)
