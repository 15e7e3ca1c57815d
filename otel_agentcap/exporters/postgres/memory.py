"""``PostgresMemory``: the captured memory of a run, kept in ``agentcap.memory`` (migration 0005), so
agents of the run in several processes share it with the guarantees of the in-process
:class:`~otel_agentcap.Memory`.

* A write and its ``memory_write`` event are one transaction (``agentcap.memory_write``): the key's
  row is locked, its old value becomes ``before``, the event row goes into ``agentcap.events``
  with the key's previous write as causal parent, and the new value and version are stored. The
  event's span carries the same event; the exporter's copy of it is then stored as a duplicate.
  The chain of write events of a key replays to its value, whatever processes wrote it.
* The event's sequence comes from the writer's clock and must be above the previous write's; when
  it is not (another agent wrote last, with a higher sequence), nothing is written, the clock moves
  past that write and the write is tried again: one round trip usually, two when the key's last
  writer was ahead.
* A read is one ``SELECT``; its ``memory_read`` event names the write it saw as causal parent and
  goes through the exporter like any other event.
* Values are stored in the payload encoding (``jsonsafe``) and read back with
  ``jsonsafe.from_jsonable`` (see :class:`~otel_agentcap.capture.ledger.JsonCodec` for what comes
  back for values JSON cannot hold), so every read returns a new object.
* When the database cannot be reached, reads and writes raise
  :class:`~otel_agentcap.errors.MemoryUnavailable`: the memory is the database.
* A write of an agent whose connection broke after it was sent may have committed: its event is
  looked for on a new connection. Found, the write was made and returns as such; not found, it is
  made again (at most twice after lost answers). A write outside any agent records no event and
  raises ``MemoryUnavailable`` then.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any, Final

import psycopg
from opentelemetry.trace import Span
from psycopg.types.json import Jsonb

from otel_agentcap import jsonsafe
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.capture.ledger import JSON_CODEC, Codec
from otel_agentcap.capture.memory import (
    MEMORY_KEY,
    MEMORY_NAME,
    MISSING,
    Lookup,
    MemoryBase,
    emit_memory_event,
)
from otel_agentcap.context import AgentContext, current_agent, current_run
from otel_agentcap.errors import MemoryUnavailable
from otel_agentcap.exporters.postgres.database import (
    Database,
    answer_lost,
    rows_waiting_for_locks_at_most,
)
from otel_agentcap.exporters.postgres.recovery import span_context_of
from otel_agentcap.model import EventRef, EventType, validate_id
from otel_agentcap.pipeline.mapping import wall_time
from otel_agentcap.pipeline.stamping import stamp

_READ: Final = b"""
SELECT found, value, version, writer_event_id, writer_seq, writer_agent_id, writer_trace_id,
    writer_span_id
FROM agentcap.memory WHERE run_id = %s AND memory = %s AND key = %s
"""
_KEYS: Final = b"""
SELECT key FROM agentcap.memory WHERE run_id = %s AND memory = %s AND found ORDER BY key
"""
_WRITE: Final = (
    b"SELECT * FROM agentcap.memory_write(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
#: Writes tried again after the key's last writer turned out to be ahead of the writer's clock,
#: or after another write took the sequence (both rare); then the write fails.
_MAX_ATTEMPTS: Final = 64
#: A write's event, if its transaction committed: read after the write's answer was lost.
_WRITTEN: Final = b"""
SELECT e.causal_parent_ids, e.payload::text FROM agentcap.events e
WHERE e.run_id = %(run)s AND e.event_id = %(event)s AND e.event_type = 'memory_write'
  AND e.run_started_at = (SELECT r.started_at FROM agentcap.runs r WHERE r.run_id = %(run)s)
"""
#: Writes whose answer was lost that are looked for and made again; then the write fails.
_LOST_ANSWERS: Final = 3


class _AnswerLost(MemoryUnavailable):
    """A statement was sent and its connection broke: whether it committed is unknown."""


_default_database: Database | None = None


def set_default_database(database: Database | None) -> None:
    """The database a ``PostgresMemory`` created without one uses (``configure()`` sets it)."""
    global _default_database
    _default_database = database


def default_database() -> Database | None:
    """The database a ``PostgresMemory`` created without one uses, if any."""
    return _default_database


class PostgresMemory(MemoryBase):
    """Memory ``name`` of a run, in PostgreSQL (see the module documentation).

    ``run_id`` defaults to the run of the calling agent (or the current ``run()`` scope), so one
    ``PostgresMemory("shared")`` serves every run; pass it to pin one run. ``database`` defaults to
    the one ``configure()`` set up."""

    def __init__(
        self,
        name: str = "memory",
        *,
        database: Database | None = None,
        run_id: str | None = None,
        codec: Codec = JSON_CODEC,
        timeout: float = 2.0,
    ) -> None:
        self.name = validate_id(name, "memory name")
        db = database if database is not None else _default_database
        if db is None:
            raise RuntimeError(
                "PostgresMemory needs a database: pass database=Database(dsn), or call "
                "otel_agentcap.configure.configure() first"
            )
        self._database = db
        self._run_id = validate_id(run_id, "run_id") if run_id is not None else None
        self._codec = codec
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"PostgresMemory({self.name!r})"

    def _run(self, ctx: AgentContext | None) -> str:
        if self._run_id is not None:
            return self._run_id
        if ctx is not None:
            return ctx.run_id
        run = current_run()
        if run is None:
            raise RuntimeError(
                "PostgresMemory is the memory of a run: use it inside ac.run(...) or an agent, or "
                "pass run_id="
            )
        return run.run_id

    def _query(
        self, query: bytes, params: Any, *, after_failure: bool = False
    ) -> list[tuple[Any, ...]]:
        """The statement's rows; raises ``MemoryUnavailable`` (``_AnswerLost`` when the connection
        broke after the statement was sent)."""
        sent = False
        try:
            with self._database.coordination(self._timeout, after_failure=after_failure) as conn:
                try:
                    sent = True
                    return rows_waiting_for_locks_at_most(conn, self._database, query, params)
                except psycopg.errors.LockNotAvailable as exc:
                    locked = exc  # raised outside: a lock is not an outage (no cool-down)
            raise MemoryUnavailable(f"memory {self.name!r} waited too long for a lock: {locked}")
        except psycopg.Error as exc:
            raise MemoryUnavailable(f"memory {self.name!r}: {exc}") from exc
        except Exception as exc:
            if isinstance(exc, MemoryUnavailable):
                raise
            lost = _AnswerLost if sent and answer_lost(exc) else MemoryUnavailable
            raise lost(f"memory {self.name!r} is unavailable: {exc}") from exc

    def keys(self) -> list[str]:
        return [str(row[0]) for row in self._query(_KEYS, (self._run(current_agent()), self.name))]

    def lookup(self, key: str) -> Lookup:
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is not None:
            ctx.check_active()
        rows = self._query(_READ, (self._run(ctx), self.name, key))
        found, stored, version, writer_id, writer_seq, writer_agent, trace_id, span_id = (
            rows[0] if rows else (False, None, 0, None, None, None, None, None)
        )
        # With the span of the write: the read's span links to it. A missing key's tombstone
        # names the delete, which the read saw as much as it would have seen a value.
        written_by = (
            EventRef(
                str(writer_id),
                int(writer_seq),
                str(writer_agent),
                span_context_of(trace_id, span_id),
            )
            if writer_id is not None
            else None
        )
        value = self._codec.decode(stored) if found else None
        result = Lookup(bool(found), value, written_by, int(version))
        if ctx is not None:
            event = stamp(ctx, EventType.MEMORY_READ, parents=(written_by,) if written_by else ())
            payload: dict[str, Any] = {"memory": self.name, "key": key, "found": bool(found)}
            if found:
                payload["value"] = self._codec.decode(stored)
            if written_by is not None:
                payload["written_by"] = written_by.event_id
            emit_memory_event("memory_read", event, jsonsafe.dumps(payload), self.name, key)
        return result

    def set(self, key: str, value: Any) -> EventRef | None:
        ref, _, _ = self._write(key, value, "set", None)
        return ref

    def delete(self, key: str) -> bool:
        _, before_found, _ = self._write(key, MISSING, "delete", None)
        return before_found

    def compare_and_set(self, key: str, expected_version: int, value: Any) -> EventRef | bool:
        if expected_version < 0:
            raise ValueError("expected_version must not be negative")
        ref, _, written = self._write(
            key, value, "delete" if value is MISSING else "set", expected_version
        )
        if not written:
            return False
        return ref if ref is not None else True

    def _write(
        self, key: str, value: Any, op: str, expected_version: int | None
    ) -> tuple[EventRef | None, bool, bool]:
        """Returns the write's event, whether the key was there, whether it wrote."""
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is not None:
            ctx.check_active()
        run_id = self._run(ctx)
        found = value is not MISSING
        encoded = Jsonb(self._codec.encode(value)) if found else None
        if ctx is None:
            row = self._call(
                (run_id, self.name, key, op, found, encoded, expected_version) + (None,) * 7
            )
            outcome, _, before_found = row[0], row[1], row[2]
            return None, bool(before_found), outcome in ("written", "unchanged")
        # The span starts without its event: the event (sequence, parents, payload) is fixed by
        # the transaction, and set on the span only once it is stored.
        span = tel.start_span("memory_write", {MEMORY_KEY: key, MEMORY_NAME: self.name})
        try:
            return self._recorded_write(
                ctx, span, run_id, key, op, found, encoded, expected_version
            )
        finally:
            tel.end_span(span)

    def _recorded_write(
        self,
        ctx: AgentContext,
        span: Span,
        run_id: str,
        key: str,
        op: str,
        found: bool,
        encoded: Jsonb | None,
        expected_version: int | None,
    ) -> tuple[EventRef | None, bool, bool]:
        context = span.get_span_context()
        trace_id = f"{context.trace_id:032x}" if context.is_valid else None
        span_id = f"{context.span_id:016x}" if context.is_valid else None
        start = getattr(span, "start_time", None)
        when = wall_time(start if isinstance(start, int) else time.time_ns())
        lost_answers = 0
        for attempt in range(_MAX_ATTEMPTS):
            # Again before each attempt: encoding the value ran the codec (the user's code, maybe),
            # and the agent may have timed out meanwhile; its write must not happen.
            ctx.check_active()
            if attempt >= 4:
                # Writers of one key in several processes keep overtaking each other: spread
                # them out a little, so that one of them gets through each round.
                time.sleep(random.uniform(0, 0.002 * attempt))
            event = stamp(ctx, EventType.MEMORY_WRITE, parents=())
            try:
                row = self._call(
                    (
                        run_id,
                        self.name,
                        key,
                        op,
                        found,
                        encoded,
                        expected_version,
                        ctx.agent_id,
                        event.event_id,
                        event.seq,
                        when,
                        list(event.causal_parent_ids),
                        trace_id,
                        span_id,
                    )
                )
            except _AnswerLost:
                lost_answers += 1
                if lost_answers >= _LOST_ANSWERS:
                    raise
                # Committed or not: its event tells (read on a new connection, at once).
                written = self._query(
                    _WRITTEN, {"run": run_id, "event": event.event_id}, after_failure=True
                )
                if not written:
                    continue  # not committed: the write is made again
                parents, payload = written[0]
                row = ("written", None, json.loads(payload)["before_found"], None, None, None)
                row += (parents, payload)
            except MemoryUnavailable as exc:
                if isinstance(exc.__cause__, psycopg.errors.UniqueViolation):
                    continue  # the sequence was taken (clock ran locally): try the next one
                raise
            outcome, _version, before_found, _, _, previous_seq, parents, payload = row
            if outcome == "retry":
                # The key's last write is ahead of this agent's clock: move past it.
                ctx.clock.observe(int(previous_seq))
                continue
            if outcome != "written":
                return None, bool(before_found), outcome == "unchanged"
            stored = event._replace(causal_parent_ids=tuple(str(p) for p in parents))
            tel.stamp_span(
                span, stored, tel.Encoded(payload), {MEMORY_KEY: key, MEMORY_NAME: self.name}
            )
            return stored.ref_on(span.get_span_context()), bool(before_found), True
        raise MemoryUnavailable(
            f"memory {self.name!r}: the write of {key!r} kept meeting newer writes"
        )

    def _call(self, params: tuple[Any, ...]) -> tuple[Any, ...]:
        rows = self._query(_WRITE, params)
        return rows[0]
