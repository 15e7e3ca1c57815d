"""The PostgreSQL event log: span exporter, schema migrations, writer, sequence blocks, embedded
server and read queries; and the state processes of a run share through it: tool ledger, spawn
registry, memory."""

from otel_agentcap.exporters.postgres.database import Database, resolve_dsn
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    ConnectionFailed,
    MigrationError,
    RunNotFound,
)
from otel_agentcap.exporters.postgres.exporter import ExportStats, PostgresSpanExporter
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
from otel_agentcap.exporters.postgres.memory import PostgresMemory
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.exporters.postgres.recovery import PostgresSpawnRegistry
from otel_agentcap.exporters.postgres.sequence_source import PostgresSequenceSource
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult

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
