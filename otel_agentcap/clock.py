"""Per-agent Lamport clocks.

One clock exists per (run, agent) in a process, shared by every thread, task and execution of that
agent, so sequences are unique and strictly increasing in program order. ``tick(after)`` implements
the Lamport rule: the new sequence is above both the agent's last sequence and ``after`` (the largest
sequence of the event's causal parents).

Across processes, uniqueness comes from a :class:`SequenceSource` that reserves disjoint blocks
atomically (the PostgreSQL store does it with one UPSERT); without one, sequences are unique within
this process only.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final, Protocol

_logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE: Final = 1024


class SequenceSource(Protocol):
    """Reserves blocks of sequences for one agent, exclusively across processes."""

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        """Return ``start >= at_least`` such that ``[start, start + size)`` belongs to the caller
        alone, and is above every sequence stored for the agent."""
        ...


class LamportClock:
    """A thread-safe logical clock for one agent."""

    __slots__ = ("_block_size", "_last", "_limit", "_lock", "_source", "agent_id", "run_id")

    def __init__(
        self,
        run_id: str,
        agent_id: str,
        source: SequenceSource | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.run_id = run_id
        self.agent_id = agent_id
        self._source = source
        self._block_size = block_size
        self._lock = threading.Lock()
        self._last = 0
        # Exclusive end of the block reserved from the source; 0 means none reserved yet.
        self._limit = 0

    @property
    def last(self) -> int:
        """The highest sequence this clock handed out or observed."""
        return self._last

    def tick(self, after: int = 0) -> int:
        """Allocate the next sequence, greater than the last one and greater than ``after``."""
        with self._lock:
            last = self._last
            candidate = (last if last > after else after) + 1
            if self._source is not None and candidate >= self._limit:
                candidate = self._reserve(candidate)
            self._last = candidate
            return candidate

    def observe(self, seq: int) -> None:
        """Move the clock past ``seq`` without allocating (a received causal parent)."""
        with self._lock:
            if seq > self._last:
                self._last = seq

    def _reserve(self, at_least: int) -> int:
        assert self._source is not None
        try:
            start = self._source.reserve(
                self.run_id, self.agent_id, at_least=at_least, size=self._block_size
            )
            if start < at_least:
                raise RuntimeError(
                    f"sequence source returned {start} below the requested {at_least}"
                )
        except Exception:
            # The store is unreachable. Capture must not fail, so continue locally, jumping to a
            # wall-clock floor (microseconds) so that another process doing the same is very
            # unlikely to collide; a collision that still happens is caught and kept by the
            # exporter's conflict handling instead of being lost.
            _logger.warning(
                "agentcap: could not reserve a sequence block for %s/%s; continuing locally",
                self.run_id,
                self.agent_id,
                exc_info=True,
            )
            start = max(at_least, time.time_ns() // 1000)
            self._limit = 0  # try the source again on the next tick
            return start
        self._limit = start + self._block_size
        return start


class ClockRegistry:
    """The process-wide map from (run, agent) to its one clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clocks: dict[tuple[str, str], LamportClock] = {}
        self._source: SequenceSource | None = None
        self._block_size = DEFAULT_BLOCK_SIZE

    def configure(
        self, source: SequenceSource | None, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> None:
        """Use ``source`` for clocks created from now on (existing clocks keep theirs)."""
        with self._lock:
            self._source = source
            self._block_size = block_size

    def get(self, run_id: str, agent_id: str) -> LamportClock:
        key = (run_id, agent_id)
        clock = self._clocks.get(key)
        if clock is not None:
            return clock
        with self._lock:
            clock = self._clocks.get(key)
            if clock is None:
                clock = LamportClock(run_id, agent_id, self._source, self._block_size)
                self._clocks[key] = clock
            return clock

    def forget_run(self, run_id: str) -> None:
        """Drop the clocks of a finished run. Only safe with a SequenceSource, which resumes
        above the stored sequences; without one a later event of the run could repeat a sequence."""
        with self._lock:
            for key in [k for k in self._clocks if k[0] == run_id]:
                del self._clocks[key]


clocks: Final = ClockRegistry()
