"""Runs: the root span of a run, a run's identity, and carrying a run to another process.

``run(run_id)`` opens the run's root span, ``invoke_workflow {run id}``: every agent started inside
it, top-level or spawned, runs in its trace. A run id is claimed when its run opens: in the event
log when one is configured (``configure()`` installs the PostgreSQL :class:`RunRegistry`), and in
this process's record of the runs it opened. A run id that is already claimed is continued only
when the caller says so:

* ``run(run_id, resume=True)`` continues the stored run (or starts it, if there is none): no new
  root span; agents run under the stored root span, in the run's trace;
* ``run(context=carried)`` continues a run whose context another process carried over with
  :func:`run_context` (W3C ``traceparent`` and the run id in W3C ``baggage``): agents run under
  the span that was current where the context was taken (a context in another trace than the
  run this process or the event log knows under that id raises ``RunExistsError``);

and otherwise fails with :class:`~otel_agentcap.errors.RunExistsError`, never merging a new run into
a stored one silently. Needs only ``opentelemetry-api``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, NamedTuple
from urllib.parse import quote, unquote

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from otel_agentcap import attributes as attr
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.context import RunContext, bind_run, current_run, new_id, reset_run
from otel_agentcap.errors import RunExistsError
from otel_agentcap.forks import renew_locks_after_fork
from otel_agentcap.model import validate_id

# Defined in otel_agentcap.protocols, with the package's other interfaces.
from otel_agentcap.protocols import RunRegistry as RunRegistry
from otel_agentcap.protocols import StoredRun as StoredRun
from otel_agentcap.runs import lifetimes

_logger = logging.getLogger("otel_agentcap")

#: The baggage entry that carries the run id (W3C baggage, percent-encoded by the propagator).
RUN_ID_BAGGAGE: Final = "agentcap.run.id"
#: The environment variable the documentation uses to hand a run to a child process.
RUN_CONTEXT_ENV: Final = "AGENTCAP_RUN_CONTEXT"
#: Run ids this process remembers having opened (most recent kept).
MAX_RECORDED_RUNS: Final = 100_000

_traceparent = TraceContextTextMapPropagator()


# --------------------------------------------------------------------------- carrying a run


@dataclass(frozen=True, slots=True)
class RunCarrier:
    """A run's context, to continue it in another process: the run id and the span to continue
    under (W3C trace context). Serialise it with :meth:`to_dict` (e.g. into a queue message's
    headers) or :meth:`to_string` (e.g. into an environment variable), and continue the run with
    ``run(context=...)``, which takes either form."""

    run_id: str
    span_context: SpanContext | None = None

    def __post_init__(self) -> None:
        validate_id(self.run_id, "run_id")
        if self.span_context is not None and not isinstance(self.span_context, SpanContext):
            raise TypeError(
                "span_context must be an opentelemetry.trace.SpanContext or None, not "
                f"{type(self.span_context).__name__}"
            )

    def to_dict(self) -> dict[str, str]:
        """``{"traceparent": ..., "baggage": "agentcap.run.id=..."}`` (W3C formats: the run id
        percent-encoded as a baggage value; no ``traceparent`` when no span was recording)."""
        carrier: dict[str, str] = {}
        if self.span_context is not None and self.span_context.is_valid:
            ctx = trace.set_span_in_context(NonRecordingSpan(self.span_context))
            _traceparent.inject(carrier, ctx)
        carrier["baggage"] = f"{RUN_ID_BAGGAGE}={quote(self.run_id, safe='')}"
        return carrier

    def to_string(self) -> str:
        """:meth:`to_dict` as one line of JSON."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, carrier: Mapping[str, str]) -> RunCarrier:
        """Read what :meth:`to_dict` wrote (keys case-insensitive, as in HTTP headers); raises
        ``ValueError`` when it names no run."""
        lowered = {str(k).lower(): str(v) for k, v in carrier.items()}
        run_id = _baggage_value(lowered.get("baggage", ""), RUN_ID_BAGGAGE)
        if run_id is None:
            raise ValueError(f"the carried context names no run (no {RUN_ID_BAGGAGE} baggage)")
        span_context = trace.get_current_span(_traceparent.extract(lowered)).get_span_context()
        if "traceparent" in lowered and not span_context.is_valid:
            # Ignoring it (as a propagator does) would start the receiver's spans in new traces.
            raise ValueError(
                f"the carried traceparent {lowered['traceparent'][:100]!r} is not a valid W3C "
                "traceparent (version-trace id-parent id-flags, ids not all zero)"
            )
        return cls(
            validate_id(run_id, "carried run id"),
            span_context if span_context.is_valid else None,
        )

    @classmethod
    def from_string(cls, text: str) -> RunCarrier:
        """Read what :meth:`to_string` wrote."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a carried run context: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("not a carried run context: expected a JSON object")
        return cls.from_dict(data)

    @classmethod
    def parse(cls, value: RunCarrier | Mapping[str, str] | str) -> RunCarrier:
        if isinstance(value, RunCarrier):
            return value
        if isinstance(value, str):
            return cls.from_string(value)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise TypeError(f"context must be a RunCarrier, dict or str, not {type(value).__name__}")


def _baggage_value(header: str, key: str) -> str | None:
    """The value of ``key`` in a W3C ``baggage`` header (members ``key=value;properties`` separated
    by commas, optional whitespace around each part, values percent-encoded)."""
    for member in header.split(","):
        name, sep, rest = member.partition("=")
        if sep and name.strip() == key:
            try:
                return unquote(rest.split(";", 1)[0].strip(), errors="strict")
            except UnicodeDecodeError:
                raise ValueError(
                    f"the carried {key} is not percent-encoded UTF-8: {rest[:100]!r}"
                ) from None
    return None


def run_context() -> RunCarrier:
    """The current run's context, to continue it in another process: the run and the current
    span (inside an agent, that agent's ``invoke_agent`` span). Raises ``RuntimeError`` outside a
    run."""
    current = current_run()
    if current is None:
        raise RuntimeError("run_context() must be called inside a run")
    span_context = trace.get_current_span().get_span_context()
    return RunCarrier(current.run_id, span_context if span_context.is_valid else None)


# --------------------------------------------------------------------------- run identity


_registry: RunRegistry | None = None


def set_run_registry(registry: RunRegistry | None) -> None:
    """Install the store-backed run registry (``configure()`` installs the PostgreSQL one)."""
    global _registry
    _registry = registry


def run_registry() -> RunRegistry | None:
    """The installed run registry, if any."""
    return _registry


class _Missing:
    __slots__ = ()


_NEW: Final = _Missing()


class _Recorded(NamedTuple):
    span: SpanContext | None
    #: Whether ``span`` is the run's root span; False for a run known here only from a carried
    #: context, whose span is where the context was taken.
    root: bool


class _RecordedRuns:
    """The runs opened in this process, with their root span: run ids are claimed here too, so
    that without a store a run id is not reused silently either. Bounded (oldest forgotten)."""

    def __init__(self, limit: int = MAX_RECORDED_RUNS) -> None:
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, _Recorded] = OrderedDict()
        self.limit = limit
        renew_locks_after_fork(self, "_lock")

    def claim(self, run_id: str, root_span: SpanContext | None) -> _Recorded | _Missing:
        """Record ``run_id`` with ``root_span`` and return ``_NEW``, or return what it was
        recorded with."""
        with self._lock:
            if run_id in self._runs:
                return self._runs[run_id]
            self._put(run_id, _Recorded(root_span, True))
            return _NEW

    def get(self, run_id: str) -> SpanContext | None:
        """The root span ``run_id`` was recorded with (None when unknown or not known)."""
        with self._lock:
            recorded = self._runs.get(run_id)
            return recorded.span if recorded is not None and recorded.root else None

    def known(self, run_id: str) -> _Recorded | None:
        """What ``run_id`` was recorded with: its root span, or a span it was carried with."""
        with self._lock:
            return self._runs.get(run_id)

    def set(self, run_id: str, root_span: SpanContext | None) -> None:
        with self._lock:
            self._put(run_id, _Recorded(root_span, True))

    def carried(self, run_id: str, span: SpanContext | None) -> None:
        """Record ``run_id`` as continued here from a context carried with ``span``, unless it
        is recorded already (with its root span, say)."""
        with self._lock:
            if run_id not in self._runs:
                self._put(run_id, _Recorded(span, False))

    def _put(self, run_id: str, recorded: _Recorded) -> None:
        self._runs[run_id] = recorded
        self._runs.move_to_end(run_id)
        while len(self._runs) > self.limit:
            self._runs.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()

    def __contains__(self, run_id: object) -> bool:
        with self._lock:
            return run_id in self._runs


recorded_runs = _RecordedRuns()


def forget_runs() -> None:
    """Forget which run ids this process opened (tests that reuse run ids call it between tests);
    the store's record is untouched."""
    recorded_runs.clear()


_unchecked_lock = threading.Lock()
renew_locks_after_fork(sys.modules[__name__], "_unchecked_lock")
_unchecked_logged_at = -3600.0


def _claim_in_store(run_id: str, root_span: SpanContext | None, start_ns: int) -> StoredRun | None:
    registry = _registry
    if registry is None:
        return None
    try:
        return registry.claim(run_id, root_span, datetime.fromtimestamp(start_ns / 1e9, tz=UTC))
    except Exception as exc:
        # Logged at most once a minute: a process opening run after run while the database is
        # down would otherwise log each one. The error's first line, no traceback: a database
        # that is down is a fault the export path expects.
        global _unchecked_logged_at
        now = time.monotonic()
        with _unchecked_lock:
            quiet = now - _unchecked_logged_at < 60
            if not quiet:
                _unchecked_logged_at = now
        if not quiet:
            text = str(exc).strip()
            _logger.warning(
                "agentcap: could not check run %s in the event log (%s); opening it (and any "
                "other run in the next minute) unchecked",
                run_id,
                text.splitlines()[0] if text else type(exc).__name__,
            )
        return None


def _start_root(run_id: str, attributes: dict[str, Any], start_ns: int) -> Span:
    span_attributes: dict[str, AttributeValue] = {
        attr.GEN_AI_OPERATION_NAME: attr.OP_INVOKE_WORKFLOW,
        attr.RUN_ID: run_id,
        attr.RUN_ROOT: True,
    }
    if attributes:
        span_attributes[attr.RUN_ATTRIBUTES] = tel.run_attributes_json(attributes)
    return tel.start_span(
        f"invoke_workflow {run_id}", span_attributes, (), SpanKind.INTERNAL, None, start_ns
    )


def _check_carried_trace(run_id: str, carried: SpanContext) -> None:
    """Raise :class:`RunExistsError` when this process or the event log knows ``run_id`` in
    another trace than the carried span's: the context was carried from another run of that id
    (in another event log, say), and continuing it would merge that run into this one."""
    known = recorded_runs.known(run_id)
    # A run continued here before is checked here: a worker taking message after message of
    # one run asks the event log once.
    root = known.span if known is not None else None
    if known is None:
        stored = _claim_in_store(run_id, None, time.time_ns())
        root = _valid(stored.root_span) if stored is not None else None
        if root is not None:
            recorded_runs.set(run_id, root)
    if root is not None and root.trace_id != carried.trace_id:
        raise RunExistsError(
            f"the context carried for run {run_id!r} is in trace {carried.trace_id:032x}, but "
            f"run {run_id!r} here is in trace {root.trace_id:032x}: it was carried from another "
            "run of that id (another event log?); continue it where that run is stored, or use "
            "a new run id"
        )


def _valid(span_context: SpanContext | None) -> SpanContext | None:
    return span_context if span_context is not None and span_context.is_valid else None


def _open(
    run_id: str, resume: bool, attributes: dict[str, Any]
) -> tuple[Span | None, SpanContext | None]:
    """Claim ``run_id``: returns the new root span (None when continuing a run) and the span
    context to run under. Raises :class:`RunExistsError` for a claimed run without ``resume``.

    The root span is started before the claim, since the claim records its ids; when the run
    turns out to exist it is dropped without being ended, so it is never exported."""
    start_ns = time.time_ns()
    root = _start_root(run_id, attributes, start_ns)
    root_span = _valid(root.get_span_context())
    prior = recorded_runs.claim(run_id, root_span)
    if not isinstance(prior, _Missing):
        if not resume:
            raise RunExistsError(
                f"run {run_id!r} was opened before in this process; use run({run_id!r}, "
                "resume=True) to continue it, or a new run id"
            )
        if not prior.root:
            # Known here only from a carried context: agents run under the stored root span
            # where the log knows it, else under the carried span (the run's trace either way).
            stored = _claim_in_store(run_id, None, start_ns)
            stored_root = _valid(stored.root_span) if stored is not None else None
            if stored_root is not None:
                recorded_runs.set(run_id, stored_root)
                return None, stored_root
        return None, prior.span
    stored = _claim_in_store(run_id, root_span, start_ns)
    if stored is not None and (not resume or _valid(stored.root_span) is not None):
        recorded_runs.set(run_id, stored.root_span)
        if not resume:
            raise RunExistsError(
                f"run {run_id!r} already exists in the event log; use run({run_id!r}, "
                "resume=True) to continue it, or a new run id"
            )
        return None, _valid(stored.root_span)
    # A new run, or a stored one without its root span (claimed where nothing was recorded,
    # OTEL_SDK_DISABLED=true say): this root span becomes the run's (the log records the first
    # root span it gets), so its agents share one trace.
    return root, root_span


@contextmanager
def run(
    run_id: str | None = None,
    *,
    resume: bool = False,
    context: RunCarrier | Mapping[str, str] | str | None = None,
    **attributes: Any,
) -> Iterator[RunContext]:
    """Run what happens inside as one run, in one trace under the run's root span
    ``invoke_workflow {run id}``.

    * ``run_id``: any id (see ``model.validate_id``); default a new ``run-`` followed by 16 random
      hex digits. An id that exists already (in the event log, or opened before in this process)
      raises :class:`~otel_agentcap.errors.RunExistsError` unless ``resume=True``.
    * ``resume=True``: continue the run if it exists (agents run under its stored root span, no
      new root span), else start it.
    * ``context``: continue a run carried from another process (:func:`run_context`; a
      :class:`RunCarrier`, or its dict or string form); ``run_id`` may be left out.
    * ``attributes``: JSON-encoded onto the root span and the spans of the run's agent executions,
      stored in ``agentcap.runs.attributes``.

    Re-entering the run that is current (nested) continues it. The run's in-process state
    (clocks, agents and their committed state, tool outcomes) is released when its last scope
    and agent execution in this process close.
    """
    carrier = RunCarrier.parse(context) if context is not None else None
    if run_id is not None:
        run_id = validate_id(run_id, "run_id")
    if carrier is not None:
        if run_id is not None and run_id != carrier.run_id:
            raise ValueError(
                f"run id {run_id!r} differs from the carried context's {carrier.run_id!r}"
            )
        run_id = carrier.run_id
    current = current_run()
    if current is not None and run_id is not None and current.run_id == run_id:
        lifetimes.enter(run_id)
        try:
            yield current
        finally:
            lifetimes.leave(run_id)
        return
    root: Span | None = None
    parent: SpanContext | None = None
    if carrier is not None:
        parent = carrier.span_context
        if parent is None:
            # Taken where no span was recording: under the run's root span as this process or
            # the event log knows it, else the run starts here, with its root span (as
            # resume=True does).
            root, parent = _open(carrier.run_id, True, attributes)
        else:
            _check_carried_trace(carrier.run_id, parent)
            recorded_runs.carried(carrier.run_id, parent)
    elif run_id is None:
        run_id = new_id("run")  # random: never stored before, but claimed for resume elsewhere
        start_ns = time.time_ns()
        root = _start_root(run_id, attributes, start_ns)
        parent = _valid(root.get_span_context())
        recorded_runs.set(run_id, parent)
        _claim_in_store(run_id, parent, start_ns)
    else:
        root, parent = _open(run_id, resume, attributes)
    assert run_id is not None
    ctx = RunContext(run_id, attributes, continued=root is None)
    token = bind_run(ctx)
    span_token = None
    if root is not None:
        span_token = otel_context.attach(trace.set_span_in_context(root))
    elif parent is not None:
        span_token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
    lifetimes.enter(run_id)
    error: BaseException | None = None
    try:
        yield ctx
    except BaseException as exc:
        error = exc
        raise
    finally:
        if span_token is not None:
            # Closed in another context (a generator finalised elsewhere): nothing to detach.
            with suppress(Exception):
                otel_context.detach(span_token)
        with suppress(ValueError):
            reset_run(token)
        lifetimes.leave(run_id)
        if root is not None:
            tel.end_span(root, error if isinstance(error, Exception) else None)
