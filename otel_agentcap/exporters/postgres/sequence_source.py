"""Sequence blocks reserved in PostgreSQL, so several processes serving one agent (or an agent
resuming after a restart) never allocate the same sequence."""

from __future__ import annotations

import logging
import threading
import time

from opentelemetry import context as otel_context

from otel_agentcap.exporters.postgres.database import Database
from otel_agentcap.exporters.postgres.errors import ConnectionFailed
from otel_agentcap.exporters.postgres.sequences import reserve_sequence_block

_logger = logging.getLogger(__name__)


class PostgresSequenceSource:
    """A :class:`~otel_agentcap.clock.SequenceSource` backed by ``agentcap.agent_sequences``.

    While the server is unreachable it fails fast for ``cooldown`` seconds instead of making
    every captured operation wait; the clock then continues locally (see ``LamportClock``).
    """

    def __init__(self, database: Database, *, timeout: float = 2.0, cooldown: float = 5.0) -> None:
        self._database = database
        self._timeout = timeout
        self._cooldown = cooldown
        self._down_until = 0.0
        self._lock = threading.Lock()

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        if time.monotonic() < self._down_until:
            raise ConnectionFailed("PostgreSQL was unreachable moments ago")
        token = otel_context.attach(
            otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True)
        )
        try:
            self._database.ensure_schema()
            with self._database.pool.connection(timeout=self._timeout) as conn:
                return reserve_sequence_block(conn, run_id, agent_id, at_least=at_least, size=size)
        except Exception:
            with self._lock:
                self._down_until = time.monotonic() + self._cooldown
            raise
        finally:
            otel_context.detach(token)
