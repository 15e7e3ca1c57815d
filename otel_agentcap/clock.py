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
import os
import random
import threading
import time
import weakref
from collections import OrderedDict
from typing import Final

# Defined in otel_agentcap.protocols, with the package's other interfaces.
from otel_agentcap.forks import renew_locks_after_fork
from otel_agentcap.protocols import SequenceSource as SequenceSource
from otel_agentcap.runs import lifetimes

_logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE: Final = 1024
DEFAULT_MAX_FINISHED_RUNS: Final = 100_000


class LamportClock:
    """A thread-safe logical clock for one agent."""

    __slots__ = (
        "__weakref__",
        "_block_size",
        "_last",
        "_limit",
        "_local",
        "_lock",
        "_registry",
        "_released",
        "_source",
        "agent_id",
        "run_id",
    )

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
        # The current block is a local one (the source failed): the source is asked every tick.
        self._local = False
        # Set by a ClockRegistry that released this clock's run (see ClockRegistry.adopt).
        self._registry: ClockRegistry | None = None
        self._released = False
        _clocks_in_process.add(self)

    @property
    def last(self) -> int:
        """The highest sequence this clock handed out or observed."""
        return self._last

    def tick(self, after: int = 0) -> int:
        """Allocate the next sequence, greater than the last one and greater than ``after``."""
        with self._lock:
            if not self._released:
                last = self._last
                candidate = (last if last > after else after) + 1
                if self._source is not None and (candidate >= self._limit or self._local):
                    candidate = self._reserve(candidate)
                self._last = candidate
                return candidate
        return self._adopted().tick(after)

    def observe(self, seq: int) -> None:
        """Move the clock past ``seq`` without allocating (a received causal parent)."""
        with self._lock:
            if not self._released:
                if seq > self._last:
                    self._last = seq
                return
        self._adopted().observe(seq)

    def attach(self, registry: ClockRegistry, floor: int) -> None:
        """Called by ``registry`` on a new clock: it continues above ``floor``."""
        self._registry = registry
        if floor:
            self._last = floor

    def reopen(self) -> None:
        """Called by the registry when a released clock is registered again."""
        with self._lock:
            self._released = False

    def release(self) -> int:
        """Called by the registry when the clock's run is forgotten: later ticks go to the
        agent's current clock. Returns the highest sequence handed out."""
        with self._lock:
            self._released = True
            return self._last

    def _adopted(self) -> LamportClock:
        """The clock that now serves this clock's agent: a context that outlived its run's release
        (a thread still running, say) ticks through the registry's clock for the agent."""
        assert self._registry is not None
        return self._registry.adopt(self)

    def after_fork_in_child(self) -> None:
        """A forked child (a pool worker forked inside an agent, say) must not hand out the rest
        of its parent's block, which the parent goes on using: its next tick reserves a block of
        its own. Its lock may have been held by a thread the child does not have."""
        self._lock = threading.Lock()
        if self._source is not None:
            self._limit = 0
            self._local = False

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
        except Exception as exc:
            # Neither the source nor its own fallback gave a block (with configure(), the host's
            # offline blocks, see exporters.durable.host_sequences, failed too). Capture must
            # not fail: continue in a local block at a random distance above, so another process
            # doing the same is unlikely to meet it (a collision that still happens is kept by
            # the log's conflict handling, not lost), asking the source again on every tick.
            # The distance is bounded, so sequences stay near the agent's high-water mark.
            _local_fallback(self._source, self, exc)
            if self._local and at_least < self._limit:
                return at_least
            start = at_least + self._block_size * random.randrange(LOCAL_JUMP // self._block_size)
            self._limit = start + self._block_size
            self._local = True
            return start
        if self._local or _failing_sources:
            _local_fallback_over(self._source)
        self._local = False
        self._limit = start + self._block_size
        return start


#: Every clock of this process (held weakly): a forked child renews their locks, and must not
#: reuse the blocks of those with a sequence source.
_clocks_in_process: weakref.WeakSet[LamportClock] = weakref.WeakSet()


def _clocks_after_fork_in_child() -> None:  # pragma: no cover - runs in a forked child
    for clock in list(_clocks_in_process):
        clock.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_clocks_after_fork_in_child)


#: The largest random distance of a local block (the last resort of ``LamportClock``) above
#: the sequence the clock needed.
LOCAL_JUMP: Final = 2**30
#: Sources whose failure is logged and not yet over (by id): one line per outage, not per tick.
_failing_sources: dict[int, float] = {}


def _local_fallback(source: object, clock: LamportClock, exc: Exception) -> None:
    """Log once per source, until a reservation from it succeeds again, that clocks continue on
    local blocks."""
    if id(source) in _failing_sources:
        return
    _failing_sources[id(source)] = time.monotonic()
    text = str(exc).strip()
    _logger.warning(
        "agentcap: could not reserve a sequence block (%s/%s: %s); clocks continue on local "
        "blocks until the sequence source answers again",
        clock.run_id,
        clock.agent_id,
        text.splitlines()[0] if text else type(exc).__name__,
    )


def _local_fallback_over(source: object) -> None:
    since = _failing_sources.pop(id(source), None)
    if since is not None:
        _logger.warning(
            "agentcap: sequence blocks are reserved from the source again after %.1f s",
            time.monotonic() - since,
        )


class ClockRegistry:
    """The process-wide map from (run, agent) to its one clock.

    :meth:`forget_run` releases a finished run's clocks (``runs.lifetimes`` calls it when the run's
    last scope closes) and keeps only the run's highest sequence, so clocks created for the run
    later start above everything it handed out; at most ``max_finished_runs`` of those are kept,
    and a run beyond them starts above the highest sequence of every run forgotten so far.
    """

    def __init__(self, max_finished_runs: int = DEFAULT_MAX_FINISHED_RUNS) -> None:
        self._lock = threading.Lock()
        self._clocks: dict[tuple[str, str], LamportClock] = {}
        self._agents_of_run: dict[str, list[str]] = {}
        # Highest sequence of each released run, oldest release first.
        self._finished: OrderedDict[str, int] = OrderedDict()
        self._forgotten_floor = 0
        self.max_finished_runs = max_finished_runs
        self._source: SequenceSource | None = None
        self._block_size = DEFAULT_BLOCK_SIZE
        renew_locks_after_fork(self, "_lock")

    def configure(
        self, source: SequenceSource | None, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> None:
        """Use ``source`` for clocks created from now on (existing clocks keep theirs)."""
        with self._lock:
            self._source = source
            self._block_size = block_size

    def configuration(self) -> tuple[SequenceSource | None, int]:
        """The source and block size clocks created from now on use."""
        with self._lock:
            return self._source, self._block_size

    def get(self, run_id: str, agent_id: str) -> LamportClock:
        key = (run_id, agent_id)
        clock = self._clocks.get(key)
        if clock is not None:
            return clock
        with self._lock:
            clock = self._clocks.get(key)
            if clock is None:
                clock = LamportClock(run_id, agent_id, self._source, self._block_size)
                clock.attach(self, self._finished.get(run_id, self._forgotten_floor))
                self._add(clock)
            return clock

    def _add(self, clock: LamportClock) -> None:
        self._clocks[(clock.run_id, clock.agent_id)] = clock
        self._agents_of_run.setdefault(clock.run_id, []).append(clock.agent_id)

    def adopt(self, clock: LamportClock) -> LamportClock:
        """The clock to use instead of the released ``clock``: the agent's current one, or
        ``clock`` itself, registered again."""
        with self._lock:
            current = self._clocks.get((clock.run_id, clock.agent_id))
            if current is not None:
                return current
            clock.reopen()
            self._add(clock)
            return clock

    def forget_run(self, run_id: str) -> None:
        """Release the clocks of a finished run, keeping its highest sequence."""
        with self._lock:
            highest = self._finished.pop(run_id, 0)
            for agent_id in self._agents_of_run.pop(run_id, ()):
                clock = self._clocks.pop((run_id, agent_id), None)
                if clock is None:
                    continue
                highest = max(highest, clock.release())
            if not highest:
                return
            finished = self._finished
            finished[run_id] = highest
            while len(finished) > self.max_finished_runs:
                _, seq = finished.popitem(last=False)
                if seq > self._forgotten_floor:
                    self._forgotten_floor = seq

    def __len__(self) -> int:
        with self._lock:
            return len(self._clocks)


clocks: Final = ClockRegistry()
lifetimes.on_release(clocks.forget_run)
