"""Spawn recovery: a spawn retried in a new process finds the child an earlier process created."""

from __future__ import annotations

from otel_agentcap.capture.agents import SpawnRecord
from otel_agentcap.exporters.postgres.database import Database
from otel_agentcap.model import EventRef

_FIND = """
SELECT a.parent_agent_id, a.name, a.spawned_at_event_id::text, e.logical_seq
FROM agentcap.agents a
JOIN agentcap.events e ON e.event_id = a.spawned_at_event_id
WHERE a.run_id = %s AND a.agent_id = %s AND a.parent_agent_id IS NOT NULL
"""


class PostgresSpawnLookup:
    """A :class:`~otel_agentcap.capture.agents.SpawnLookup` over ``agentcap.agents``.

    It sees spawns that an earlier process exported; a spawn still in another live process's
    export queue is not visible yet (that process's own registry answers its own retries)."""

    def __init__(self, database: Database, *, timeout: float = 2.0) -> None:
        self._database = database
        self._timeout = timeout

    def find(self, run_id: str, child_agent_id: str) -> SpawnRecord | None:
        with self._database.quick_connection(self._timeout) as conn:
            row = conn.execute(_FIND, (run_id, child_agent_id)).fetchone()
            conn.rollback()
        if row is None:
            return None
        parent, name, event_id, seq = row
        return SpawnRecord(str(parent), name, EventRef(str(event_id), int(seq), str(parent)))
