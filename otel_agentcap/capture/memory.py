"""A captured key-value memory shared by the agents of a process.

Every mutation and its ``memory_write`` event are one atomic step: the value before, the value
after, the event's sequence and its causal link to the previous write of the key are all fixed
under one lock, so the chain of write events of a key replays to its final value. A read names the
write it observed as a causal parent, so the reader's clock moves past that write.

A missing key and a key holding ``None`` differ: payloads carry ``before_found`` / ``after_found``
/ ``found`` flags, and :meth:`Memory.lookup` returns a :class:`Lookup` that says which.
Memory is shared, so it is not rolled back when an agent execution fails (agent state is).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry.trace import Span

from otel_agentcap import jsonsafe
from otel_agentcap.capture import _telemetry as tel
from otel_agentcap.context import current_agent
from otel_agentcap.model import EventRef, EventType, validate_id
from otel_agentcap.stamping import Stamp, stamp

MEMORY_KEY: Final = "agentcap.memory.key"
MEMORY_NAME: Final = "agentcap.memory.name"


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


@dataclass(frozen=True, slots=True)
class Lookup:
    """The outcome of a read: ``found`` is False for a missing key, True for a stored ``None``."""

    found: bool
    value: Any = None
    written_by: EventRef | None = None


#: Deleted keys whose delete the key's next write still names as causal parent (the most recent
#: ones are kept).
DEFAULT_MAX_DELETED_KEYS: Final = 10_000


@dataclass(slots=True)
class _Slot:
    value: Any
    written_by: EventRef | None


class Memory:
    """A thread-safe, captured key-value store. Keys are strings."""

    def __init__(self, name: str = "memory") -> None:
        self.name = validate_id(name, "memory name")
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        # The recorded deletes of keys not written since, oldest first, so the next write of a
        # key still chains to its delete; bounded, as keys come and go in a long-lived process.
        self._deletes: OrderedDict[str, EventRef] = OrderedDict()
        self.max_deleted_keys = DEFAULT_MAX_DELETED_KEYS

    def __repr__(self) -> str:
        return f"Memory({self.name!r}, {len(self._slots)} keys)"

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.lookup(key).found

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._slots))

    def __getitem__(self, key: str) -> Any:
        found = self.lookup(key)
        if not found.found:
            raise KeyError(key)
        return found.value

    def __setitem__(self, key: str, value: Any) -> None:
        self.set(key, value)

    def __delitem__(self, key: str) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        found = self.lookup(key)
        return found.value if found.found else default

    def snapshot(self) -> dict[str, Any]:
        """The current contents, without recording a read."""
        with self._lock:
            return {key: slot.value for key, slot in self._slots.items()}

    def lookup(self, key: str) -> Lookup:
        """Read ``key``, recording a ``memory_read`` event inside an agent."""
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is not None:
            ctx.check_active()
        with self._lock:
            slot = self._slots.get(key)
            found = Lookup(True, slot.value, slot.written_by) if slot is not None else Lookup(False)
            if ctx is None:
                return found
            parents = (found.written_by,) if found.written_by is not None else ()
            event = stamp(ctx, EventType.MEMORY_READ, parents=parents)
            payload: dict[str, Any] = {"memory": self.name, "key": key, "found": found.found}
            if found.found:
                payload["value"] = found.value
            if found.written_by is not None:
                payload["written_by"] = found.written_by.event_id
            # Serialised under the lock (the value may be mutated later), emitted outside it
            # (an exporter running synchronously must not hold up other agents).
            encoded = jsonsafe.dumps(payload)
        self._emit("memory_read", event, encoded, key)
        return found

    def set(self, key: str, value: Any) -> EventRef | None:
        """Store ``value``; returns the ``memory_write`` event (None outside an agent)."""
        return self._write(key, value, "set")[0]

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it was there. Recorded as a write with
        ``after_found: false``."""
        return self._write(key, MISSING, "delete")[1]

    def _write(self, key: str, value: Any, op: str) -> tuple[EventRef | None, bool]:
        key = validate_id(key, "memory key")
        ctx = current_agent()
        if ctx is not None:
            ctx.check_active()
        pending: Span | None = None
        with self._lock:
            before = self._slots.get(key)
            if before is None and value is MISSING:
                return None, False  # deleting a missing key changes nothing: no event
            if ctx is None:
                # Not recorded: the next recorded write must not claim to follow the last
                # recorded one, whose "after" this write just made stale.
                event_ref = None
                self._deletes.pop(key, None)
            else:
                previous = before.written_by if before is not None else self._deletes.get(key)
                event = stamp(ctx, EventType.MEMORY_WRITE, parents=(previous,) if previous else ())
                payload: dict[str, Any] = {
                    "memory": self.name,
                    "key": key,
                    "op": op,
                    "before_found": before is not None,
                    "after_found": value is not MISSING,
                }
                if before is not None:
                    payload["before"] = before.value
                if value is not MISSING:
                    payload["after"] = value
                # Serialised here under the lock, so later mutation of a stored object cannot
                # change what the event says. The span starts here too, so the write's reference
                # (which the key's next read and write link to) names its span; it ends after
                # the lock is released (an exporter running synchronously must not hold up
                # other agents).
                pending = self._start("memory_write", event, jsonsafe.dumps(payload), key)
                event_ref = event.ref_on(pending.get_span_context())
            if value is MISSING:
                self._slots.pop(key, None)
                if event_ref is not None:
                    deletes = self._deletes
                    deletes[key] = event_ref
                    deletes.move_to_end(key)
                    while len(deletes) > self.max_deleted_keys:
                        deletes.popitem(last=False)
            else:
                self._slots[key] = _Slot(value, event_ref)
                self._deletes.pop(key, None)
        if pending is not None:
            tel.end_span(pending)
        return event_ref, before is not None

    def _emit(self, name: str, event: Stamp, encoded_payload: str, key: str) -> None:
        tel.end_span(self._start(name, event, encoded_payload, key))

    def _start(self, name: str, event: Stamp, encoded_payload: str, key: str) -> Span:
        return tel.start_event_span(
            name,
            event,
            tel.Encoded(encoded_payload),
            {MEMORY_KEY: key, MEMORY_NAME: self.name},
        )
