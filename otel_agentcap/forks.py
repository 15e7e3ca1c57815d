"""What keeps the package's objects usable in a child of ``os.fork()``.

A forked child inherits the parent's objects but none of its other threads: a lock that one of
them held at the fork stays held in the child, and the child's first call that needs it (a clock
tick, a new agent, a tool call) waits forever. A pool worker forked while other threads of an
agent program capture is the usual case. Objects that own such locks have them renewed here; a
connection or file descriptor shared with the parent is given up by a method the object registers.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable


def call_in_child_after_fork(method: Callable[[], None]) -> None:
    """Call the bound ``method`` in the child after every fork, for as long as its object lives
    (it is held weakly)."""
    if not hasattr(os, "register_at_fork"):
        return
    ref = weakref.WeakMethod(method)

    def run() -> None:  # pragma: no cover - runs in a forked child
        bound = ref()
        if bound is not None:
            bound()

    os.register_at_fork(after_in_child=run)


#: Objects whose named lock attributes are replaced by new, free locks in a forked child.
_renewed: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()
_renewed_lock = threading.Lock()


def renew_locks_after_fork(owner: object, *names: str) -> None:
    """In a forked child, replace ``owner``'s attributes ``names`` (each a ``threading.Lock`` or
    ``RLock``) with new ones, for as long as ``owner`` lives (it is held weakly). For objects made
    now and then (a registry, an agent, a memory), not per operation."""
    with _renewed_lock:
        _renewed[owner] = names


def new_lock_like(lock: object) -> object:
    """A new, free lock of the kind of ``lock`` (``RLock`` or ``Lock``)."""
    return threading.RLock() if isinstance(lock, type(threading.RLock())) else threading.Lock()


def _renew_locks_in_child() -> None:  # pragma: no cover - runs in a forked child
    global _renewed_lock
    _renewed_lock = threading.Lock()
    for owner, names in list(_renewed.items()):
        for name in names:
            setattr(owner, name, new_lock_like(getattr(owner, name)))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks_in_child)
