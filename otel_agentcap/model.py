"""The event model shared by capture, the span mapping, the exporters and the testing helpers.

Pure data: no I/O, no OpenTelemetry SDK.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar, cast

if TYPE_CHECKING:  # the API's SpanContext, only as a type: the model imports no OpenTelemetry
    from opentelemetry.trace import SpanContext

#: Namespace of deterministic event ids: ``uuid5(EVENT_NAMESPACE, run \x1f agent \x1f key)``.
EVENT_NAMESPACE: Final = uuid.UUID("5b0f6f7e-3c55-4d2b-9a51-6a3d7f0c2e11")

#: The longest id, in UTF-8 bytes.
MAX_ID_LENGTH: Final = 512


class EventType(enum.StrEnum):
    MODEL_CALL = "model_call"
    TOOL_INVOCATION = "tool_invocation"
    TOOL_RESULT = "tool_result"
    MEMORY_READ = "memory_read"
    MEMORY_WRITE = "memory_write"
    AGENT_SPAWN = "agent_spawn"
    AGENT_START = "agent_start"
    AGENT_END = "agent_end"
    AGENT_ERROR = "agent_error"


EVENT_TYPES: Final = frozenset(t.value for t in EventType)


def validate_id(value: object, what: str) -> str:
    """Return ``value`` if it is a usable id (a non-empty str without NUL or U+001F, at most 512
    bytes in UTF-8), as a plain ``str``.

    Raises ``ValueError`` (or ``TypeError`` for non-strings) at the call that passed it, so a bad id
    never becomes a database error later. The limit is in bytes because that is what PostgreSQL's
    indexes bound (an index entry of run, agent and idempotency key must stay under 2,704 bytes).
    """
    if (
        type(value) is str
        and value.isascii()  # the common case: then its size in UTF-8 is its length
        and 0 < len(value) <= MAX_ID_LENGTH
        and "\x00" not in value
        and "\x1f" not in value
        and not value.isspace()
    ):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if type(value) is not str:
        # A str subclass may override __str__ and __format__; what counts is its character data.
        value = str.__str__(value)
    if not value or not value.strip():
        raise ValueError(f"{what} must be a non-empty string")
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL characters")
    if "\x1f" in value:
        # The separator of event_id_for: allowing it would let two events share an id.
        raise ValueError(f"{what} must not contain the unit separator (U+001F)")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 (lone surrogate)") from exc
    if size > MAX_ID_LENGTH:
        raise ValueError(f"{what} is longer than {MAX_ID_LENGTH} bytes in UTF-8 ({size})")
    return value


_NAMESPACE_BYTES: Final = EVENT_NAMESPACE.bytes


# CPython's own SHA-1 rather than OpenSSL's: for inputs this short the hash is negligible and
# OpenSSL's per-call setup dominates; measured in a traced model call (cold caches), hashlib.sha1
# took about 30 us per id. The ids are the same either way.
def _sha1_constructor() -> Callable[[bytes], Any]:
    try:
        return cast(Callable[[bytes], Any], importlib.import_module("_sha1").sha1)
    except (ImportError, AttributeError):  # an interpreter built without the builtin hashes
        return functools.partial(hashlib.sha1, usedforsecurity=False)


_sha1 = _sha1_constructor()


def event_id_prefix(run_id: str, agent_id: str) -> bytes:
    """What every event id of one agent hashes first (see :func:`event_id_in`)."""
    return _NAMESPACE_BYTES + f"{run_id}\x1f{agent_id}\x1f".encode()


def event_id_for(run_id: str, agent_id: str, idempotency_key: str) -> str:
    """The deterministic id of an event: a retried event gets the id of its first copy.

    Equal to ``str(uuid.uuid5(EVENT_NAMESPACE, f"{run_id}\\x1f{agent_id}\\x1f{idempotency_key}"))``,
    computed on the hex digest without building a ``UUID`` object (this runs for every captured
    event): the version nibble becomes 5 and the variant nibble's top bits 10."""
    return event_id_in(event_id_prefix(run_id, agent_id), idempotency_key)


def event_id_in(prefix: bytes, idempotency_key: str) -> str:
    """:func:`event_id_for` with the agent's :func:`event_id_prefix` computed once."""
    h = _sha1(prefix + idempotency_key.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


#: RFC 4122 variant: the top two bits of the nibble at hex digit 16 become 10.
_VARIANT: Final = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}


_Row = TypeVar("_Row", bound=tuple[Any, ...])


def from_fields(cls: type[_Row]) -> Callable[[tuple[object, ...]], _Row]:
    """A constructor of the NamedTuple ``cls`` that takes all its fields as one tuple, in field
    order: ``tuple.__new__`` in C, for the hot paths, instead of the generated Python ``__new__``."""
    return cast(Callable[[tuple[object, ...]], _Row], functools.partial(tuple.__new__, cls))


class EventRef(NamedTuple):
    """Enough of an event to name it as a causal parent: its id, its sequence, and (when known)
    the span that carries it, which a child event's span links to."""

    event_id: str
    seq: int
    agent_id: str = ""
    span: SpanContext | None = None

    def to_list(self) -> list[str | int]:
        """This reference as JSON values, to keep next to a value for readers in other processes:
        ``[event_id, seq, agent_id]``, then the hex trace and span ids of its span when known, so
        that the reader's event links to it (``list(ref)`` holds the span object itself, which
        JSON cannot encode). :meth:`from_list` reads it back."""
        values: list[str | int] = [self.event_id, self.seq, self.agent_id]
        span = self.span
        if span is not None and span.is_valid:
            values += [f"{span.trace_id:032x}", f"{span.span_id:016x}"]
        return values

    @classmethod
    def from_list(cls, values: Sequence[Any]) -> EventRef:
        """The reference :meth:`to_list` wrote (its span a remote span context); ``ValueError``
        for anything else."""
        from opentelemetry.trace import SpanContext  # only here: the model imports no OTel

        items = list(values)
        if len(items) not in (3, 5):
            raise ValueError(f"not an EventRef list: expected 3 or 5 values, got {len(items)}")
        event_id, seq, agent_id = items[:3]
        if not isinstance(event_id, str) or not isinstance(agent_id, str):
            raise ValueError("not an EventRef list: event id and agent id must be strings")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ValueError("not an EventRef list: the sequence must be an int")
        span = None
        if len(items) == 5:
            trace_hex, span_hex = items[3:]
            try:
                if not isinstance(trace_hex, str) or not isinstance(span_hex, str):
                    raise ValueError
                span = SpanContext(int(trace_hex, 16), int(span_hex, 16), is_remote=True)
            except ValueError:
                raise ValueError("not an EventRef list: trace and span ids must be hex") from None
            if not span.is_valid:
                raise ValueError("not an EventRef list: trace and span ids are not valid")
        return cls(event_id, seq, agent_id, span)


class Event(NamedTuple):
    """One row of the event log (a NamedTuple: immutable, cheap to build by the thousand)."""

    event_id: str
    run_id: str
    agent_id: str
    seq: int
    event_type: str
    idempotency_key: str
    wall_time: datetime
    causal_parent_ids: tuple[str, ...] = ()
    payload: Any = None
    trace_id: str | None = None
    span_id: str | None = None

    @property
    def ref(self) -> EventRef:
        return EventRef(self.event_id, self.seq, self.agent_id)


@dataclass(frozen=True, slots=True)
class AgentRecord:
    """One row of the agents table. ``name`` ``None`` is unknown, not "no name".

    ``lineage_known`` says whether the record knows the agent's lineage: then ``parent_agent_id``
    ``None`` means a root agent, else the parent and its spawn event; without it, both are
    ``None`` and say nothing (a span other than the agent's ``agent_start`` or its parent's
    ``agent_spawn`` does not know where the agent came from). The log keeps the first known name
    and lineage of an agent (first writer wins)."""

    run_id: str
    agent_id: str
    name: str | None = None
    parent_agent_id: str | None = None
    spawned_at_event_id: str | None = None
    lineage_known: bool = False


class RunRecord(NamedTuple):
    """One row of the runs table. ``attributes`` ``None``: the record does not declare the run's
    attributes (the run's root span and the spans of its agent executions do, when it has
    some); the log keeps the first
    declaration (first writer wins). ``started_at`` is the earliest event time the record knows;
    the log keeps the start of the first record it stores for the run. ``start_recorded``: the
    start is the one a log recorded for the run (an imported run record), which the first write
    of the run keeps as it is, also when its batch holds an earlier event or span."""

    run_id: str
    started_at: datetime | None
    attributes: Mapping[str, Any] | None = None
    #: The run's root span (``ac.run``), hex, when this record comes from it.
    trace_id: str | None = None
    root_span_id: str | None = None
    start_recorded: bool = False


class SpanRecord(NamedTuple):
    """The envelope of one span that carries a run's events (or is the run's root span): what a
    trace viewer needs beyond the events to draw the trace as it was recorded. Ids are hex."""

    run_id: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    #: OpenTelemetry ``SpanKind`` value (0 internal, 1 server, 2 client, 3 producer, 4 consumer).
    kind: int
    start_time: datetime
    end_time: datetime
    #: 0 unset, 1 ok, 2 error (OpenTelemetry ``StatusCode`` values).
    status_code: int = 0
    status_message: str | None = None
    service_name: str | None = None
    scope_name: str | None = None


class Batch(NamedTuple):
    """What one export writes: events plus the agent and run rows they imply (a tuple, like
    ``Event``: the mapping builds one per export).

    ``superseded`` holds ``model_call`` events that record the same API call as an event in
    ``events`` (same run, and the same response id or request id) under another event id: the log
    keeps one event per call and stores these in ``agentcap.conflicts``, never in ``events``."""

    events: tuple[Event, ...] = ()
    agents: tuple[AgentRecord, ...] = ()
    runs: tuple[RunRecord, ...] = ()
    superseded: tuple[Event, ...] = ()
    #: For each of ``superseded``, the id of the event of ``events`` kept for its call (empty when
    #: not known, as in a hand-built batch: storage then matches the ids itself).
    superseded_by: tuple[str, ...] = ()
    #: Closing events the spans held but that could not be read back (an attribute value length
    #: limit cut their record before its identity): counted, since they cannot be stored.
    unreadable: int = 0
    #: The envelopes of the spans that carried the events (and of run root spans).
    spans: tuple[SpanRecord, ...] = ()
    #: Spans left out because their records could not be read or were refused (see
    #: ``mapping.batch_from_spans``): each span's position among those mapped, and why.
    rejected: tuple[tuple[int, str], ...] = ()
    #: Runs whose declared attributes (``agentcap.run.attributes``) are not a JSON object (not
    #: JSON, cut by a length limit say, or a list, a string, a number): kept whole as
    #: ``{"$agentcap.unparsed": text}``, never dropped, and listed here to be counted.
    unparsed_attributes: tuple[str, ...] = ()
