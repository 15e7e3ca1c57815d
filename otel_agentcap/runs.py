"""Which runs are open in this process, and the release of a run's in-process state when its last
scope closes.

A run is open while any ``run()`` scope or agent execution of it is open in this process. When the
last one closes, the registries that keep per-run state (clocks, agents, tool outcomes, causal
links) release that run's entries through the hooks registered here, so a long-running process that
serves one run after another holds the state of its open runs only. A run entered again later starts
afresh in this process, as it would in a new process: sequences continue above the released ones,
and the event log (deterministic event ids) and the PostgreSQL store (spawns, sequence blocks) carry
what the process no longer holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from otel_agentcap.forks import renew_locks_after_fork

_logger = logging.getLogger(__name__)

ReleaseHook = Callable[[str], None]


class RunLifetimes:
    """Counts the open scopes of each run and calls the release hooks when a count drops to 0."""

    def __init__(self) -> None:
        # Held while hooks run, so a run cannot be entered again half-released.
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self._hooks: list[ReleaseHook] = []
        renew_locks_after_fork(self, "_lock")

    def on_release(self, hook: ReleaseHook) -> None:
        """Call ``hook(run_id)`` whenever a run's last open scope closes. Hooks must not enter
        or leave runs."""
        with self._lock:
            self._hooks.append(hook)

    def enter(self, run_id: str) -> None:
        with self._lock:
            self._open[run_id] = self._open.get(run_id, 0) + 1

    def leave(self, run_id: str) -> None:
        with self._lock:
            count = self._open.get(run_id, 0) - 1
            if count > 0:
                self._open[run_id] = count
                return
            self._open.pop(run_id, None)
            for hook in self._hooks:
                try:
                    hook(run_id)
                except Exception:
                    _logger.exception("agentcap: could not release the state of run %s", run_id)

    def is_open(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self._open


lifetimes = RunLifetimes()
