"""``WriterThreads``: several ``EventWriter``s, each on a thread and connection of its own.

Events are partitioned by agent (:func:`partition_of`): all rows of one agent always go to the
same writer, so two transactions of this process never insert rows of one agent at the same time
(which could deadlock them), while different agents are written in parallel. Each writer takes
its work in order (a queue per thread), so the batches of one agent are stored in the order they
were handed over.

The threads are daemon threads: a writer stuck on an unresponsive server never keeps the process
from exiting (what it was writing is still in the durable queue, or counted by the exporter).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, TypeVar

from .connection import DedicatedConnection
from .rows import DEFAULT_MAX_PAYLOAD_CHARS
from .writer import EventWriter, RunStartCache

_logger = logging.getLogger(__name__)
_T = TypeVar("_T")
DEFAULT_WRITERS: Final = 2
#: How long :meth:`WriterThreads.pause` sleeps while a writer is storing.
HANDOFF_PAUSE: Final = 0.0001


def partition_of(run_id: object, agent_id: object, count: int) -> int:
    """The writer (0 to ``count - 1``) that stores the events of ``(run_id, agent_id)``."""
    if count == 1:
        return 0
    return hash((run_id, agent_id)) % count


class _Writer:
    def __init__(
        self,
        index: int,
        dsn: str,
        connect_timeout: float,
        max_payload_chars: int,
        run_starts: RunStartCache,
    ) -> None:
        self.index = index
        self.connection = DedicatedConnection(
            dsn, connect_timeout=connect_timeout, application_name=f"otel-agentcap-writer-{index}"
        )
        self.writer = EventWriter(
            self.connection,
            connect_timeout=connect_timeout,
            max_payload_chars=max_payload_chars,
            run_starts=run_starts,
        )
        self.jobs: queue.SimpleQueue[tuple[Callable[[EventWriter], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.busy = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"agentcap-writer-{index}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                break
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            self.busy.set()
            try:
                future.set_result(fn(self.writer))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                self.busy.clear()
        self.close_connection()

    def close_connection(self) -> None:
        self.writer.close()
        self.connection.close()


class WriterThreads:
    """``count`` writers on their own threads and connections to ``dsn``."""

    def __init__(
        self,
        dsn: str,
        count: int = DEFAULT_WRITERS,
        *,
        connect_timeout: float = 5.0,
        max_payload_chars: int = DEFAULT_MAX_PAYLOAD_CHARS,
    ) -> None:
        if count < 1:
            raise ValueError("count must be at least 1")
        self.count = count
        #: The run starts the writers have read, for the COPY data built ahead of them.
        self.run_starts = RunStartCache()
        self._writers = [
            _Writer(i, dsn, connect_timeout, max_payload_chars, self.run_starts)
            for i in range(count)
        ]
        self._closed = False

    def submit(self, index: int, fn: Callable[[EventWriter], _T]) -> Future[_T]:
        """Run ``fn(writer)`` on writer ``index``'s thread, after what it was given before."""
        future: Future[_T] = Future()
        if self._closed:
            future.set_exception(RuntimeError("the writers are closed"))
            return future
        self._writers[index].jobs.put((fn, future))
        return future

    def pause(self) -> None:
        """Called by a thread that maps the next batch, between slices of that work: while a
        writer is storing, sleep ``HANDOFF_PAUSE`` seconds, so that the writer's thread takes
        the GIL as soon as its server answers.

        Without the pause a writer woken by its socket waits for the GIL until the mapping
        thread is made to drop it, after the interpreter's switch interval (5 ms by default, a
        setting of the host's that a library must leave alone), and PostgreSQL sits idle
        meanwhile: a batch is several such waits (each statement's answer, each full socket
        buffer of COPY data). Mapping is not what limits delivery (it takes less time per event
        than the server's COPY), so its thread can give up that time."""
        for writer in self._writers:
            if writer.busy.is_set():
                time.sleep(HANDOFF_PAUSE)
                return

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the threads once their queued work is done; waits up to ``timeout`` seconds in
        all. Returns whether every thread ended (one still writing is left to finish alone, and
        closes its connection then)."""
        self._closed = True
        for writer in self._writers:
            writer.jobs.put(None)
        deadline = time.monotonic() + timeout
        ended = True
        for writer in self._writers:
            writer.thread.join(max(0.0, deadline - time.monotonic()))
            ended = ended and not writer.thread.is_alive()
        return ended
