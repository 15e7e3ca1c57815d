"""Sequence blocks reserved in PostgreSQL, so several processes serving one agent (or an agent
resuming after a restart) never allocate the same sequence."""

from __future__ import annotations

from otel_agentcap.exporters.postgres.database import Database
from otel_agentcap.exporters.postgres.sequences import reserve_sequence_block


class PostgresSequenceSource:
    """A :class:`~otel_agentcap.clock.SequenceSource` backed by ``agentcap.agent_sequences``.

    While the server is unreachable it fails fast (see ``Database.quick_connection``); the clock
    then continues locally (see ``LamportClock``).
    """

    def __init__(self, database: Database, *, timeout: float = 2.0) -> None:
        self._database = database
        self._timeout = timeout

    def reserve(self, run_id: str, agent_id: str, *, at_least: int, size: int) -> int:
        with self._database.quick_connection(self._timeout) as conn:
            return reserve_sequence_block(conn, run_id, agent_id, at_least=at_least, size=size)
