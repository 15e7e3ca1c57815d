"""``FaultLog``: faults of the export path logged once per change of state, with counts.

An outage produces one line when it starts (what failed, since when, how much is waiting), at
most one reminder a minute while it lasts, and one line when it ends (after how long, how much
waited); never a line per captured operation or per retry, and never a traceback for a fault the
library expects (a server that is down, a full disk). Each fault is a named *condition*, e.g.
``"database"`` or ``"disk"``; conditions are independent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from otel_agentcap.forks import call_in_child_after_fork

_logger = logging.getLogger("otel_agentcap.export")

REMINDER_EVERY_S: Final = 60.0


@dataclass
class _Condition:
    since: float
    wall_since: float
    reason: str
    count: int = 1
    reminded: float = 0.0


class FaultLog:
    """Tracks named fault conditions and logs their changes (thread-safe).

    ``waiting`` returns the text describing what waits (e.g. ``"1,200 spans waiting on disk"``);
    it is called only when a line is written.
    """

    def __init__(
        self,
        waiting: Callable[[], str] | None = None,
        *,
        logger: logging.Logger = _logger,
        reminder_every: float = REMINDER_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: Describes what waits, for the log lines (settable once the queue exists).
        self.waiting = waiting
        self._logger = logger
        self._reminder_every = reminder_every
        self._clock = clock
        self._lock = threading.Lock()
        self._active: dict[str, _Condition] = {}
        self.changes = 0
        call_in_child_after_fork(self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork

    def _what_waits(self) -> str:
        waiting = self.waiting
        if waiting is None:
            return ""
        try:
            text = waiting()
        except Exception:
            return ""
        return f"; {text}" if text else ""

    def is_active(self, condition: str) -> bool:
        return condition in self._active  # a dict lookup: atomic, and cheap on the hot path

    def since(self, condition: str) -> float | None:
        """Seconds the condition has lasted, or None when it is not active."""
        with self._lock:
            active = self._active.get(condition)
            return None if active is None else self._clock() - active.since

    def fault(self, condition: str, reason: str, *, consequence: str = "") -> None:
        """Record one occurrence of ``condition`` (e.g. a failed attempt). Logs when the condition
        starts, and a reminder at most every ``reminder_every`` seconds while it lasts."""
        now = self._clock()
        reason = " ".join(reason.split())  # one line, whatever the error's text holds
        with self._lock:
            active = self._active.get(condition)
            if active is None:
                self._active[condition] = _Condition(now, time.time(), reason)
                self.changes += 1
                started = True
            else:
                active.count += 1
                active.reason = reason
                if now - max(active.since, active.reminded) < self._reminder_every:
                    return
                active.reminded = now
                started = False
                duration = now - active.since
                count = active.count
        if started:
            self._logger.warning(
                "agentcap: %s: %s%s%s",
                condition,
                reason,
                f"; {consequence}" if consequence else "",
                self._what_waits(),
            )
        else:
            self._logger.warning(
                "agentcap: %s: still failing after %.0f s (%d failures, last: %s)%s",
                condition,
                duration,
                count,
                reason,
                self._what_waits(),
            )

    def recovered(self, condition: str, *, detail: str = "") -> None:
        """Record that ``condition`` is over; logs once if it was active."""
        if condition not in self._active:  # unlocked fast path: the common case
            return
        now = self._clock()
        with self._lock:
            active = self._active.pop(condition, None)
            if active is None:
                return
            self.changes += 1
        self._logger.warning(
            "agentcap: %s: recovered after %.1f s (%d failures)%s%s",
            condition,
            now - active.since,
            active.count,
            f"; {detail}" if detail else "",
            self._what_waits(),
        )
