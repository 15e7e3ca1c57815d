"""Where model calls and tool results meet: bounded, per-run registries that turn the ids the
Messages API passes around (response ids, ``tool_use`` ids) into the events that recorded them.

* The span processor records each finished ``model_call`` under its response id and the ``tool_use``
  ids it asked for.
* :func:`~otel_agentcap.run_tool_uses` finds the model call of a response there (the causal parent
  of each tool run) and records each tool's result event under its ``tool_use`` id.
* The instrumentation's request wrapper finds the ``tool_result`` blocks a request carries and
  names the recorded result events as causal parents of the model call.

Entries are keyed by run, so one run never links to another's events; a run's entries are released
when the run's last scope in this process closes (``runs.lifetimes``), and each registry keeps the
most recent :data:`MAX_ENTRIES` entries. Nothing here raises into user code.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Final

from otel_agentcap.forks import renew_locks_after_fork
from otel_agentcap.model import EventRef
from otel_agentcap.runs import lifetimes

MAX_ENTRIES: Final = 50_000


class _Bounded:
    """A thread-safe LRU map of at most ``limit`` entries, keyed by (run, id), whose entries of
    one run can be released in time proportional to their number."""

    def __init__(self, limit: int = MAX_ENTRIES) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        renew_locks_after_fork(self, "_lock")
        self._runs: dict[str, dict[str, EventRef]] = {}
        # Keys, oldest first. An OrderedDict, not a dict: deleting a plain dict's first entry
        # leaves a hole that every later ``next(iter(...))`` scans past until the dict resizes,
        # so evicting the oldest costs O(n) per put once the map is full.
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()

    def put(self, key: tuple[str, str], ref: EventRef) -> None:
        run_id, item_id = key
        order = self._order
        with self._lock:
            items = self._runs.get(run_id)
            if items is None:
                items = self._runs[run_id] = {}
            items[item_id] = ref
            order[key] = None
            order.move_to_end(key)
            if len(order) > self._limit:
                (old_run, old_id), _ = order.popitem(last=False)
                old_items = self._runs[old_run]
                del old_items[old_id]
                if not old_items:
                    del self._runs[old_run]

    def get(self, key: tuple[str, str]) -> EventRef | None:
        with self._lock:
            items = self._runs.get(key[0])
            return items.get(key[1]) if items is not None else None

    def forget_run(self, run_id: str) -> None:
        with self._lock:
            for item_id in self._runs.pop(run_id, ()):
                del self._order[(run_id, item_id)]

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._order.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)


_by_response = _Bounded()
_by_tool_use = _Bounded()
_tool_results = _Bounded()


def record_model_call(
    run_id: str,
    ref: EventRef,
    *,
    response_id: str | None = None,
    tool_use_ids: Iterable[str] = (),
) -> None:
    """Remember the ``model_call`` event ``ref`` under the ids of its response."""
    if response_id:
        _by_response.put((run_id, response_id), ref)
    for tool_use_id in tool_use_ids:
        _by_tool_use.put((run_id, tool_use_id), ref)


def model_call_for_response(run_id: str, response_id: str) -> EventRef | None:
    return _by_response.get((run_id, response_id))


def model_call_for_tool_use(run_id: str, tool_use_id: str) -> EventRef | None:
    """The model call whose response asked for ``tool_use_id``."""
    return _by_tool_use.get((run_id, tool_use_id))


def record_tool_result(run_id: str, tool_use_id: str, ref: EventRef) -> None:
    """Remember ``ref`` as the event that answered ``tool_use_id`` (its result or its error),
    for its agent and for the run."""
    _tool_results.put((run_id, tool_use_id), ref)
    if ref.agent_id:
        _tool_results.put((run_id, f"{ref.agent_id}\x1f{tool_use_id}"), ref)


def tool_result_for(run_id: str, tool_use_id: str, agent_id: str | None = None) -> EventRef | None:
    """The event that answered ``tool_use_id``: ``agent_id``'s own when that agent answered it
    (tool runs are deduplicated per agent, so two agents may each answer one id), else the run's
    latest (the tool ran in another agent)."""
    if agent_id:
        ref = _tool_results.get((run_id, f"{agent_id}\x1f{tool_use_id}"))
        if ref is not None:
            return ref
    return _tool_results.get((run_id, tool_use_id))


def forget_run(run_id: str) -> None:
    for registry in (_by_response, _by_tool_use, _tool_results):
        registry.forget_run(run_id)


lifetimes.on_release(forget_run)


def clear() -> None:
    """Forget everything (tests)."""
    for registry in (_by_response, _by_tool_use, _tool_results):
        registry.clear()


def _get(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        return value.get(key)
    return getattr(value, key, None)


def new_tool_result_ids(messages: Any) -> list[str]:
    """The ``tool_use_id`` of each ``tool_result`` block in the last message of ``messages`` (the
    results a request sends back now; earlier turns were linked when they were sent)."""
    try:
        if not isinstance(messages, list | tuple) or not messages:
            return []
        last = messages[-1]
        if _get(last, "role") != "user":
            return []
        content = _get(last, "content")
        if not isinstance(content, list | tuple):
            return []
        ids: list[str] = []
        for block in content:
            if _get(block, "type") == "tool_result":
                tool_use_id = _get(block, "tool_use_id")
                if isinstance(tool_use_id, str) and tool_use_id not in ids:
                    ids.append(tool_use_id)
        return ids
    except Exception:
        return []


def request_parents(
    run_id: str, messages: Any, agent_id: str | None = None
) -> tuple[EventRef, ...]:
    """The recorded tool-result events for the ``tool_result`` blocks a request of ``agent_id``
    carries."""
    parents: list[EventRef] = []
    for tool_use_id in new_tool_result_ids(messages):
        ref = tool_result_for(run_id, tool_use_id, agent_id)
        if ref is not None and ref not in parents:
            parents.append(ref)
    return tuple(parents)
