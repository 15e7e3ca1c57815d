"""The PostgreSQL event log: span exporter, schema migrations, writer, sequence blocks, embedded
server and read queries; and the state processes of a run share through it: tool ledger, spawn
registry, memory."""

from typing import TYPE_CHECKING

from otel_agentcap.exporters.postgres.database import Database, resolve_dsn
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    ConnectionFailed,
    MigrationError,
    RunNotFound,
)
from otel_agentcap.exporters.postgres.migrate import migrate  # also a submodule's name: eager
from otel_agentcap.lazy_exports import lazy_exports

# The rest (the span exporter, the writer, the shared state) needs the OpenTelemetry SDK, which
# the command line's read commands do not: imported on first use.
if TYPE_CHECKING:
    from otel_agentcap.exporters.postgres.exporter import ExportStats, PostgresSpanExporter
    from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
    from otel_agentcap.exporters.postgres.memory import PostgresMemory
    from otel_agentcap.exporters.postgres.recovery import PostgresSpawnRegistry
    from otel_agentcap.exporters.postgres.sequence_source import PostgresSequenceSource
    from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult

_EXPORTS = {
    "ExportStats": "otel_agentcap.exporters.postgres.exporter",
    "PostgresSpanExporter": "otel_agentcap.exporters.postgres.exporter",
    "PostgresToolLedger": "otel_agentcap.exporters.postgres.ledger",
    "PostgresMemory": "otel_agentcap.exporters.postgres.memory",
    "PostgresSpawnRegistry": "otel_agentcap.exporters.postgres.recovery",
    "PostgresSequenceSource": "otel_agentcap.exporters.postgres.sequence_source",
    "EventWriter": "otel_agentcap.exporters.postgres.writer",
    "WriteResult": "otel_agentcap.exporters.postgres.writer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "AgentCapStorageError",
    "ConnectionFailed",
    "Database",
    "EventWriter",
    "ExportStats",
    "MigrationError",
    "PostgresMemory",
    "PostgresSequenceSource",
    "PostgresSpanExporter",
    "PostgresSpawnRegistry",
    "PostgresToolLedger",
    "RunNotFound",
    "WriteResult",
    "migrate",
    "resolve_dsn",
]
