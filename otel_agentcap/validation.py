"""Field validation of what enters the event log: one set of rules for every writer.

The exporter, the OTLP ingest and any hand-built ``Batch`` pass through
``exporters.postgres.rows.prepare``, which checks every event, agent row and run row here before
any of it reaches SQL; the ingest also checks each span with these rules, to reject spans one by
one. A record that breaks a rule is rejected with a reason (a short English sentence); nothing
is ever stored half-checked.

The rules:

- run, agent and parent agent ids and agent names: :func:`otel_agentcap.model.validate_id` (a
  non-empty ``str`` without NUL or U+001F, at most 512 bytes of UTF-8), as the capture API checks
  them when they are passed;
- idempotency keys: a non-empty ``str`` without NUL, valid UTF-8, at most
  :data:`MAX_KEY_BYTES` bytes;
- event ids: exactly :func:`otel_agentcap.model.event_id_for` of the event's run, agent and
  key, so a span cannot store an event under another run's or another event's id;
- spawn links: a child's ``spawned_at_event_id`` is the id of its parent's ``agent_spawn``
  event for it (key ``spawn:{child}``), and a root has neither parent nor spawn link;
- event types: one of :data:`otel_agentcap.model.EVENT_TYPES`;
- sequences: an ``int`` in ``[0, max_sequence()]`` (see :func:`max_sequence`);
- times: timezone-aware, from :data:`MIN_WALL_TIME` (which rejects unset, epoch-zero times) to
  :data:`MAX_FUTURE` after now;
- causal parent ids: UUIDs, at most :data:`MAX_CAUSAL_PARENTS`.

Payloads and run attributes are not restricted: storage turns any value into JSON it can keep
(``jsonsafe``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from otel_agentcap.model import (
    EVENT_TYPES,
    AgentRecord,
    Event,
    RunRecord,
    event_id_in,
    event_id_prefix,
    validate_id,
)

#: How far a sequence may run ahead of the wall clock, in microseconds (2**40 us, about 12.7
#: days): see :func:`max_sequence`.
SEQUENCE_CLOCK_ALLOWANCE: Final = 2**40
#: No sequence is ever accepted above this, whatever the clock says (2**62: room is left for
#: sequence blocks reserved above a stored sequence without overflowing PostgreSQL's bigint).
SEQUENCE_CEILING: Final = 2**62
#: The longest idempotency key, in UTF-8 bytes (the longest the capture API makes is a
#: ``tool:{512-byte id}\x1fattempt{n}:invocation`` key; run, agent and key together must fit a
#: PostgreSQL index entry of 2,704 bytes).
MAX_KEY_BYTES: Final = 1024
#: The most causal parents one event may name.
MAX_CAUSAL_PARENTS: Final = 10_000
#: The earliest event time accepted: an unset time (0, the epoch) is no capture time.
MIN_WALL_TIME: Final = datetime(2000, 1, 1, tzinfo=UTC)
#: How far after now an event time may be (clocks of other hosts may be ahead).
MAX_FUTURE: Final = timedelta(days=366)
#: The longest trace or span id text (the mapping writes 32 and 16 hex digits).
MAX_TRACE_TEXT: Final = 128


def max_sequence(now_ns: int | None = None) -> int:
    """The largest logical sequence accepted at ``now_ns`` (default: now).

    It is the wall clock in microseconds plus :data:`SEQUENCE_CLOCK_ALLOWANCE`, capped at
    :data:`SEQUENCE_CEILING`. A clock that reserves its sequences in PostgreSQL counts up from 0;
    a clock that lost the database continues above a wall-clock floor in microseconds (about
    1.8e15 today), so legitimate sequences stay below this bound. A sender that forges a sequence
    near it moves one agent's later sequences up by at most the allowance, and the bound itself
    grows by a million a second, faster than any agent records events: the range can never be
    exhausted, unlike a bound of 2**63 - 1 that a single forged span could reach.
    """
    now = time.time_ns() if now_ns is None else now_ns
    return min(now // 1000 + SEQUENCE_CLOCK_ALLOWANCE, SEQUENCE_CEILING)


def uuid_text(value: object) -> bool:
    """Whether ``value`` is the text of a UUID (hyphens anywhere, at most 40 characters)."""
    if not isinstance(value, str) or len(value) > 40:
        return False
    try:
        return len(bytes.fromhex(value.replace("-", ""))) == 16
    except ValueError:
        return False


def check_key(key: object) -> str | None:
    """Why ``key`` cannot be an idempotency key, or None."""
    if type(key) is not str:
        return f"idempotency key must be a str, not {type(key).__name__}"
    if not key:
        return "idempotency key must not be empty"
    if "\x00" in key:
        return "idempotency key must not contain NUL"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "idempotency key is not valid UTF-8 (lone surrogate)"
    if size > MAX_KEY_BYTES:
        return f"idempotency key is longer than {MAX_KEY_BYTES} bytes ({size})"
    return None


def _id_reason(value: object, what: str) -> str | None:
    try:
        validate_id(value, what)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


class Validator:
    """Checks records against the rules above, at one moment (``now``).

    Keeps the outcome of the id checks of each (run, agent) pair it met, so a batch of many
    events of a few agents checks each pair once, and the ids of the events it accepted, which
    later events name as causal parents (in plain dicts and sets: threads may share it).
    """

    __slots__ = ("_events", "_ids", "_max_seq", "_max_time", "_prefixes")

    def __init__(self, now_ns: int | None = None) -> None:
        now = time.time_ns() if now_ns is None else now_ns
        self._max_seq = max_sequence(now)
        self._max_time = datetime.fromtimestamp(now / 1e9, tz=UTC) + MAX_FUTURE
        self._prefixes: dict[tuple[object, object], bytes | str] = {}
        self._ids: dict[object, str | None] = {}
        #: Ids of events accepted by the inline check (each the text of a UUID).
        self._events: set[str] = set()

    @property
    def max_seq(self) -> int:
        return self._max_seq

    def id_reason(self, value: object, what: str) -> str | None:
        """Why ``value`` is not a valid id (``what`` names it in the reason), or None."""
        if type(value) is str:
            known = self._ids.get(value, _UNSEEN)
            if known is not _UNSEEN:
                return None if known is None else f"{what}: {known}"
        reason = _id_reason(value, "id")
        if type(value) is str and len(self._ids) < 10_000:
            self._ids[value] = reason
        return None if reason is None else f"{what}: {reason}"

    def _prefix(self, run_id: object, agent_id: object) -> bytes | str:
        """The event-id prefix of (run, agent), or why one of them is invalid."""
        pair = (run_id, agent_id)
        known = self._prefixes.get(pair)
        if known is not None:
            return known
        reason = self.id_reason(run_id, "run id") or self.id_reason(agent_id, "agent id")
        result: bytes | str = (
            reason if reason is not None else event_id_prefix(str(run_id), str(agent_id))
        )
        if len(self._prefixes) < 10_000:
            self._prefixes[pair] = result
        return result

    def time_reason(self, value: object, what: str) -> str | None:
        if not isinstance(value, datetime) or value.tzinfo is None:
            return f"{what} must be a timezone-aware datetime"
        if value < MIN_WALL_TIME:
            return f"{what} {value.isoformat()} is before {MIN_WALL_TIME.date()} (unset?)"
        if value > self._max_time:
            return f"{what} {value.isoformat()} is more than {MAX_FUTURE.days} days ahead"
        return None

    def event(self, event: Event) -> str | None:
        """Why ``event`` cannot be stored, or None."""
        # The common case, checked inline: an Event with the exact types the mapping makes, an
        # ASCII key and an agent met before. The checks run in the order of ``event_reason``
        # (a value whose comparison raises raises at the same point); anything else goes there.
        if type(event) is Event:
            (
                event_id,
                run_id,
                agent_id,
                seq,
                event_type,
                key,
                wall_time,
                parents,
                _,
                trace,
                span,
            ) = event
            if (
                type(event_type) is str
                and event_type in EVENT_TYPES
                and type(prefix := self._prefixes.get((run_id, agent_id))) is bytes
                and type(key) is str
                and key.isascii()
                and 0 < len(key) <= MAX_KEY_BYTES
                and "\x00" not in key
                and type(event_id) is str
                and event_id == event_id_in(prefix, key)
                and type(seq) is int
                and 0 <= seq <= self._max_seq
                and type(wall_time) is datetime
                and wall_time.tzinfo is not None
                and MIN_WALL_TIME <= wall_time <= self._max_time
                and type(parents) is tuple
                and len(parents) <= MAX_CAUSAL_PARENTS
                and (
                    # Most often the one parent is an event this validator accepted.
                    (len(parents) == 1 and type(parents[0]) is str and parents[0] in self._events)
                    or all(map(uuid_text, parents))
                )
                and (trace is None or (type(trace) is str and len(trace) <= MAX_TRACE_TEXT))
                and (span is None or (type(span) is str and len(span) <= MAX_TRACE_TEXT))
            ):
                if len(self._events) < 10_000:
                    self._events.add(event_id)
                return None
        return self.event_reason(event)

    def event_reason(self, event: Event) -> str | None:
        """:meth:`event` without its fast path for the common case: the rules as written."""
        if not isinstance(event.event_type, str) or event.event_type not in EVENT_TYPES:
            return f"unknown event type {event.event_type!r}"
        prefix = self._prefix(event.run_id, event.agent_id)
        if type(prefix) is str:
            return prefix
        key = event.idempotency_key
        reason = check_key(key)
        if reason is not None:
            return reason
        assert type(prefix) is bytes
        if event.event_id != event_id_in(prefix, key):
            return (
                f"event id {str(event.event_id)[:40]!r} is not the id of its run, agent and "
                "idempotency key"
            )
        seq = event.seq
        if type(seq) is not int:
            return f"sequence must be an int, not {type(seq).__name__}"
        if not 0 <= seq <= self._max_seq:
            return f"sequence {seq} is outside [0, {self._max_seq}]"
        reason = self.time_reason(event.wall_time, "event time")
        if reason is not None:
            return reason
        parents = event.causal_parent_ids
        if type(parents) is not tuple and not isinstance(parents, list | tuple):
            return "causal parent ids must be a sequence of UUIDs"
        if len(parents) > MAX_CAUSAL_PARENTS:
            return f"more than {MAX_CAUSAL_PARENTS} causal parents ({len(parents)})"
        for parent in parents:
            if not uuid_text(parent):
                return f"causal parent id {str(parent)[:40]!r} is not a UUID"
        for value, what in ((event.trace_id, "trace id"), (event.span_id, "span id")):
            if value is not None and (type(value) is not str or len(value) > MAX_TRACE_TEXT):
                return f"{what} must be a str of at most {MAX_TRACE_TEXT} characters"
        return None

    def agent(self, record: AgentRecord) -> str | None:
        """Why the agent row ``record`` cannot be stored, or None."""
        prefix = self._prefix(record.run_id, record.agent_id)
        if type(prefix) is str:
            return prefix
        if record.name is not None:
            reason = self.id_reason(record.name, "agent name")
            if reason is not None:
                return reason
        parent, spawned_at = record.parent_agent_id, record.spawned_at_event_id
        if not record.lineage_known:
            if parent is not None or spawned_at is not None:
                return "a parent or spawn link given without the lineage being known"
            return None
        if parent is None:
            if spawned_at is not None:
                return "a spawn link without a parent agent"
            return None
        reason = self.id_reason(parent, "parent agent id")
        if reason is not None:
            return reason
        if parent == record.agent_id:
            return "an agent cannot be its own parent"
        parent_prefix = self._prefix(record.run_id, parent)
        assert type(parent_prefix) is bytes
        expected = event_id_in(parent_prefix, f"spawn:{record.agent_id}")
        if spawned_at != expected:
            return (
                f"spawn link {str(spawned_at)[:40]!r} is not the id of the parent's agent_spawn "
                "event for this agent"
            )
        return None

    def run(self, record: RunRecord) -> str | None:
        """Why the run row ``record`` cannot be stored, or None."""
        reason = self.id_reason(record.run_id, "run id")
        if reason is not None:
            return reason
        if record.started_at is not None:
            reason = self.time_reason(record.started_at, "run start")
            if reason is not None:
                return reason
        if record.attributes is not None and not isinstance(record.attributes, Mapping):
            return "run attributes must be a mapping"
        return None


_UNSEEN: Any = object()
