"""Captured key-value memory shared by agents, and recording of a store you already have.

:class:`Memory` is shared by the agents of a process. Every mutation and its ``memory_write`` event
are one atomic step: the value before, the value after, the event's sequence and its causal link
to the previous write of the key are all fixed under one lock, so the chain of write events of a
key replays to its final value. A read names the write it observed as a causal parent, so the
reader's clock moves past that write. The memory keeps its own copies: a value is copied when it
is stored and again when it is read, so nobody can change a stored value in place, behind the
log's back. Each write gives the key a new version (:attr:`Lookup.version`), which
:meth:`Memory.compare_and_set` compares.

A missing key and a key holding ``None`` differ: payloads carry ``before_found`` / ``after_found``
/ ``found`` flags, and :meth:`Memory.lookup` returns a :class:`Lookup` that says which.
Memory is shared, so it is not rolled back when an agent execution fails (agent state is).

The same interface backed by PostgreSQL, for agents of a run in several processes, is
:class:`otel_agentcap.exporters.postgres.PostgresMemory`. :class:`MemoryRecorder` records the reads
and writes of a store of your own (a file, a key-value server, a vector index) as memory events
with the same causal rules.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections import OrderedDict
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry.trace import Span

from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.capture.values import private_copy
from otel_agentcap.context import AgentContext, current_agent
from otel_agentcap.forks import call_in_child_after_fork, renew_locks_after_fork
from otel_agentcap.model import EventRef, EventType, validate_id
from otel_agentcap.pipeline.span_attributes import add_attributes
from otel_agentcap.pipeline.stamping import Stamp, stamp

# Defined in otel_agentcap.protocols, with the package's other interfaces.
from otel_agentcap.protocols import Lookup as Lookup
from otel_agentcap.protocols import MemoryBase as MemoryBase

_logger = logging.getLogger("otel_agentcap")

MEMORY_KEY: Final = "agentcap.memory.key"
MEMORY_NAME: Final = "agentcap.memory.name"


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        # The module's MISSING itself: copied (a replayed tool result is a private copy) or
        # pickled, the sentinel must stay the one ``is MISSING`` tests for.
        return "MISSING"


MISSING: Final = _Missing()


#: Deleted keys whose delete the key's next write still names as causal parent (the most recent
#: ones are kept).
DEFAULT_MAX_DELETED_KEYS: Final = 10_000


#: The live memories (``Memory``, ``MemoryRecorder``) of this process by name, and the names
#: warned about: two live objects of one name are two stores whose events the log cannot tell
#: apart (their payloads name the same memory and key).
_named: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
_warned_names: set[str] = set()
_named_lock = threading.Lock()
renew_locks_after_fork(sys.modules[__name__], "_named_lock")


def _claim_name(name: str, memory: object) -> None:
    """Note ``memory`` as the live memory named ``name``; warn (once per name) when another
    one of that name is still alive."""
    with _named_lock:
        other = _named.get(name)
        if other is None:
            _named[name] = memory
            return
        if name in _warned_names:
            return
        _warned_names.add(name)
    _logger.warning(
        "agentcap: a second memory named %r in this process (a %s; the first is a %s): each "
        "object is a store of its own, and the log cannot tell their events apart, so the "
        "writes of a key form two chains under one name; share one object, or give each its "
        "own name",
        name,
        type(memory).__name__,
        type(other).__name__,
    )


@dataclass(slots=True)
class _Slot:
    value: Any
    written_by: EventRef | None
    version: int


def _read_payload(
    memory: str, key: str, found: bool, value: Any, written_by: EventRef | None
) -> str:
    """``{"memory", "key", "found", "value"?, "written_by"?}`` as JSON. Only the value is encoded
    with ``jsonsafe.dumps``: a value over the size limit becomes a truncation marker under
    ``value`` while the memory, key and provenance stay readable (as a tool's payload keeps its
    tool and invocation id)."""
    text = f'{{"memory":{tel.json_string(memory)},"key":{tel.json_string(key)},"found":'
    text += "true" if found else "false"
    if found:
        text += f',"value":{jsonsafe.dumps(value)}'
    if written_by is not None:
        text += f',"written_by":{jsonsafe.dumps(written_by.event_id)}'
    return text + "}"


def _write_payload(memory: str, key: str, op: str, before: Any, after: Any) -> str:
    """``{"memory", "key", "op", "before_found", "after_found", "before"?, "after"?}`` as JSON,
    each value bounded on its own (see :func:`_read_payload`)."""
    before_found = before is not MISSING
    after_found = after is not MISSING
    text = (
        f'{{"memory":{tel.json_string(memory)},"key":{tel.json_string(key)},'
        f'"op":{tel.json_string(op)},"before_found":{"true" if before_found else "false"},'
        f'"after_found":{"true" if after_found else "false"}'
    )
    if before_found:
        text += f',"before":{jsonsafe.dumps(before)}'
    if after_found:
        text += f',"after":{jsonsafe.dumps(after)}'
    return text + "}"


def emit_memory_event(name: str, event: Stamp, encoded_payload: str, memory: str, key: str) -> None:
    """The span of one memory event (``memory_read`` / ``memory_write``), started and ended."""
    span = tel.start_event_span(
        name,
        event,
        tel.Encoded(encoded_payload),
        {MEMORY_KEY: key, MEMORY_NAME: memory},
    )
    tel.end_span(span)


def start_write_span(event: Stamp, memory: str, key: str) -> Span:
    """The span of a ``memory_write`` event, started without its payload: it starts while the
    write holds its lock, so the write's reference (which the key's next read and write link to)
    names its span, and the payload is encoded after the lock is released
    (:func:`finish_write_span`)."""
    attributes = event.attributes()
    attributes[MEMORY_KEY] = key
    attributes[MEMORY_NAME] = memory
    return tel.start_span("memory_write", attributes, event.links)


class _NotEncoded:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<not encoded: the write was interrupted while its payload was encoded>"


_NOT_ENCODED: Final = _NotEncoded()


def finish_write(span: Span, memory: str, key: str, op: str, before: Any, after: Any) -> None:
    """Encode the payload of a write's span (from :func:`start_write_span`) and end it. A write
    interrupted while its payload is encoded (Ctrl-C during a large value) has happened, and the
    key's next write names it: its span still ends, with a ``$agentcap.repr`` marker in place of
    the values (``before_found`` / ``after_found`` stay true)."""
    encoded: str | None = None
    try:
        encoded = _write_payload(memory, key, op, before, after)
    finally:
        if encoded is None:
            encoded = _write_payload(
                memory,
                key,
                op,
                before if before is MISSING else _NOT_ENCODED,
                after if after is MISSING else _NOT_ENCODED,
            )
        finish_write_span(span, encoded)


def finish_write_span(span: Span, encoded_payload: str) -> None:
    """Set the payload of a span from :func:`start_write_span` and end it."""
    try:
        add_attributes(span, {attr.EVENT_PAYLOAD: encoded_payload})
    except Exception:
        _logger.exception("agentcap: could not record a memory write")
    tel.end_span(span)


class Memory(MemoryBase):
    """A thread-safe, captured key-value store. Keys are strings; values are kept as private
    copies (``copy.deepcopy`` semantics; a value that cannot be copied is kept as it is).

    The object is the store and ``name`` labels its events: share one object. A second live
    memory of the same name in the process is another store whose events the log cannot tell
    apart from this one's; creating one logs a warning (once per name)."""

    def __init__(self, name: str = "memory") -> None:
        self.name = validate_id(name, "memory name")
        _claim_name(self.name, self)
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        # The recorded deletes of keys not written since, oldest first, so the next write of a
        # key still chains to its delete; bounded, as keys come and go in a long-lived process.
        self._deletes: OrderedDict[str, tuple[EventRef, int]] = OrderedDict()
        renew_locks_after_fork(self, "_lock")
        self.max_deleted_keys = DEFAULT_MAX_DELETED_KEYS
        # One counter for every key: a key's version never repeats, also after its delete was
        # forgotten.
        self._revision = 0

    def __repr__(self) -> str:
        return f"Memory({self.name!r}, {len(self._slots)} keys)"

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._slots)

    def snapshot(self) -> dict[str, Any]:
        """Copies of the current contents, without recording a read."""
        with self._lock:
            items = [(key, slot.value) for key, slot in self._slots.items()]
        return {key: private_copy(value) for key, value in items}

    def lookup(self, key: str) -> Lookup:
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is not None:
            ctx.check_active()
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                deleted = self._deletes.get(key)
                written_by, version = deleted if deleted is not None else (None, 0)
                stored, found = None, False
            else:
                written_by, version, stored, found = (
                    slot.written_by,
                    slot.version,
                    slot.value,
                    True,
                )
            if ctx is None:
                event = None
            else:
                # The read's sequence is fixed under the lock, after the write it saw: the one
                # that stored the value, or the delete that removed it.
                parents = (written_by,) if written_by is not None else ()
                event = stamp(ctx, EventType.MEMORY_READ, parents=parents)
        # A stored value is never changed in place (writes replace it), so it can be copied and
        # encoded outside the lock.
        result = Lookup(found, private_copy(stored), written_by, version)
        if event is not None:
            encoded = _read_payload(self.name, key, found, stored, result.written_by)
            emit_memory_event("memory_read", event, encoded, self.name, key)
        return result

    def set(self, key: str, value: Any) -> EventRef | None:
        return self._write(key, value, "set", None)[0]

    def delete(self, key: str) -> bool:
        return self._write(key, MISSING, "delete", None)[1]

    def compare_and_set(self, key: str, expected_version: int, value: Any) -> EventRef | bool:
        event_ref, _, written = self._write(
            key, value, "delete" if value is MISSING else "set", expected_version
        )
        if not written:
            return False
        return event_ref if event_ref is not None else True

    def _write(
        self, key: str, value: Any, op: str, expected_version: int | None
    ) -> tuple[EventRef | None, bool, bool]:
        """Returns the write's event, whether the key was there, whether it wrote."""
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is not None:
            ctx.check_active()
        stored = MISSING if value is MISSING else private_copy(value)
        pending: tuple[Span, Any] | None = None
        try:
            with self._lock:
                if ctx is not None:
                    # Again under the lock: copying the value runs the user's code (a
                    # __deepcopy__), and the agent may have timed out meanwhile; its write must
                    # not happen.
                    ctx.check_active()
                before = self._slots.get(key)
                deleted = self._deletes.get(key) if before is None else None
                version = before.version if before is not None else (deleted[1] if deleted else 0)
                if expected_version is not None and version != expected_version:
                    return None, before is not None, False
                if before is None and value is MISSING:
                    return None, False, True  # deleting a missing key changes nothing: no event
                self._revision += 1
                revision = self._revision
                span: Span | None = None
                if ctx is None:
                    # Not recorded: the next recorded write must not claim to follow the last
                    # recorded one, whose "after" this write just made stale.
                    event_ref = None
                    self._deletes.pop(key, None)
                else:
                    previous = before.written_by if before is not None else (deleted or (None,))[0]
                    event = stamp(
                        ctx, EventType.MEMORY_WRITE, parents=(previous,) if previous else ()
                    )
                    span = start_write_span(event, self.name, key)
                    event_ref = event.ref_on(span.get_span_context())
                if value is MISSING:
                    self._slots.pop(key, None)
                    if event_ref is not None:
                        deletes = self._deletes
                        deletes[key] = (event_ref, revision)
                        deletes.move_to_end(key)
                        while len(deletes) > self.max_deleted_keys:
                            deletes.popitem(last=False)
                else:
                    self._slots[key] = _Slot(stored, event_ref, revision)
                    self._deletes.pop(key, None)
                if span is not None:
                    # Set once the write is done: from here on its event is recorded, whatever
                    # interrupts the rest.
                    pending = (span, before.value if before is not None else MISSING)
        finally:
            if pending is not None:
                # Both values are private and never changed in place: encoded outside the lock
                # (an exporter running synchronously must not hold up other agents either).
                finish_write(pending[0], self.name, key, op, pending[1], stored)
        return event_ref, before is not None, True


class MemoryRecorder:
    """Records reads and writes of a store you already have (a file, a key-value server, a vector
    index) as ``memory_read`` / ``memory_write`` events named ``name``, with the causal rules of
    :class:`Memory`: a write names the key's previous write as its causal parent, a read names the
    write it saw, and each advances the agent's clock past its parent.

    The recorder remembers the last write it recorded for each key (the ``max_keys`` most recent
    keys). Across processes, store the :class:`~otel_agentcap.EventRef` a write returns next to the
    value (``ref.to_list()``, JSON values with its span's ids; ``EventRef.from_list(stored)``
    reads it back, and the reader's event links to the write's span) and pass it as ``written_by`` /
    ``previous``. For ``before`` / ``after`` to be the true transition, hold :meth:`lock` (or the
    store's own lock or transaction) around reading the old value, writing the store and recording
    the write::

        recorder = MemoryRecorder("kv")
        with recorder.lock(key):
            old = store.get(key, MISSING)
            store[key] = value
            recorder.record_write(key, before=old, after=value)

    Outside an agent nothing is recorded and the methods return None.
    """

    def __init__(self, name: str, *, max_keys: int = 100_000) -> None:
        self.name = validate_id(name, "memory name")
        _claim_name(self.name, self)
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._last_write: OrderedDict[str, EventRef] = OrderedDict()
        self._key_locks: dict[str, threading.RLock] = {}
        call_in_child_after_fork(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:  # pragma: no cover - runs in a forked child
        self._lock = threading.Lock()
        self._key_locks = {}

    def lock(self, key: str) -> AbstractContextManager[bool]:
        """A per-key lock (reentrant) for making a store operation and its record one step in
        this process."""
        lock = self._key_locks.get(key)
        if lock is None:
            lock = self._key_locks.setdefault(key, threading.RLock())
        return lock

    def record_write(
        self,
        key: str,
        *,
        before: Any = MISSING,
        after: Any = MISSING,
        previous: EventRef | None = None,
        op: str | None = None,
    ) -> EventRef | None:
        """Record a write of ``key`` from ``before`` to ``after`` (:data:`MISSING` for absent:
        a delete has ``after=MISSING``). Its causal parent is ``previous`` if given, else the last
        write of the key this recorder recorded."""
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is None:
            return None
        ctx.check_active()
        with self._lock:
            parent = previous if previous is not None else self._last_write.get(key)
            event = stamp(ctx, EventType.MEMORY_WRITE, parents=(parent,) if parent else ())
            span = start_write_span(event, self.name, key)
            ref = event.ref_on(span.get_span_context())
            self._remember(key, ref)
        kind = op if op is not None else ("delete" if after is MISSING else "set")
        finish_write(span, self.name, key, kind, before, after)
        return ref

    def record_read(
        self, key: str, value: Any = MISSING, *, written_by: EventRef | None = None
    ) -> EventRef | None:
        """Record a read of ``key`` that found ``value`` (:data:`MISSING`: not found). Its causal
        parent is ``written_by`` if given, else the last write of the key this recorder
        recorded."""
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is None:
            return None
        ctx.check_active()
        return self._record_read(ctx, key, value, written_by)

    def _record_read(
        self, ctx: AgentContext, key: str, value: Any, written_by: EventRef | None
    ) -> EventRef:
        with self._lock:
            parent = written_by if written_by is not None else self._last_write.get(key)
            event = stamp(ctx, EventType.MEMORY_READ, parents=(parent,) if parent else ())
        found = value is not MISSING
        encoded = _read_payload(self.name, key, found, value if found else None, parent)
        emit_memory_event("memory_read", event, encoded, self.name, key)
        return event.ref

    def _remember(self, key: str, ref: EventRef) -> None:
        last = self._last_write
        last[key] = ref
        last.move_to_end(key)
        while len(last) > self.max_keys:
            old, _ = last.popitem(last=False)
            self._key_locks.pop(old, None)
