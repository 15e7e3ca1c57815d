"""``call_in_child_after_fork``: how the export path's objects stay usable in a forked child.

A child of ``os.fork()`` inherits the parent's objects but none of its other threads; a lock one
of them held stays held, and a connection or file descriptor is shared with the parent. Objects
that own such things register a method that gives the child its own.
"""

from __future__ import annotations

import os
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
