"""The exceptions of the PostgreSQL storage layer: one hierarchy, rooted at ``AgentCapStorageError``.

``retryable`` tells a caller (the span exporter) whether sending the same batch again later can
succeed (the server was unreachable, writers contended) or cannot (the batch itself is invalid,
the server rejected it for a reason that will not go away by itself).
"""

from __future__ import annotations

from typing import ClassVar


class AgentCapStorageError(Exception):
    """Base class of every error raised by ``otel_agentcap.exporters.postgres``."""

    retryable: ClassVar[bool] = False


class ConnectionFailed(AgentCapStorageError):
    """The server could not be reached, or the connection broke during an operation."""

    retryable = True


class LockWaitTimeout(AgentCapStorageError):
    """A query waited for a lock that another session held on a table of the log (a migration,
    other DDL, an explicit ``LOCK TABLE``) longer than the session's ``lock_timeout``, and gave
    up (see ``store.limit_lock_waits``)."""

    retryable = True


class MigrationError(AgentCapStorageError):
    """Applying the schema migrations failed; the database is left at its previous version."""


class SchemaNotReady(AgentCapStorageError):
    """The ``agentcap`` schema or one of its tables is missing: run ``migrate()`` first."""


class WriteFailed(AgentCapStorageError):
    """The server rejected a batch; the whole batch was rolled back."""


class WriteContention(WriteFailed):
    """Concurrent writers kept colliding with this batch until the attempts ran out."""

    retryable = True


class WritesRefused(WriteFailed):
    """The server takes no writes from this connection now, whatever the rows: it is read-only
    (a hot standby, ``default_transaction_read_only``) or the role lacks a privilege on the log
    (not the writer role of ``otel-agentcap db grant``, or a privilege revoked). Like a server
    that is down, the batch waits and is sent again: the condition is the operator's to fix."""

    retryable = True


class DataRejected(WriteFailed):
    """The server refused the batch for the values it holds (a constraint, an index entry over
    its size limit, a value of the wrong form): the same rows will be refused again, while the
    other rows of the batch could be stored without them."""


class InvalidPayload(DataRejected):
    """The server rejected a payload as JSON (e.g. text cut by an attribute length limit)."""


class InvalidBatch(DataRejected):
    """The batch holds values that can never be stored (e.g. an event id that is not a UUID)."""


class RunNotFound(AgentCapStorageError, LookupError):
    """No run with the requested id is stored."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run not found: {run_id!r}")
        self.run_id = run_id


class EventNotFound(AgentCapStorageError, LookupError):
    """No event with the requested id is stored in the run."""

    def __init__(self, run_id: str, event_id: str) -> None:
        super().__init__(f"event not found in run {run_id!r}: {event_id!r}")
        self.run_id = run_id
        self.event_id = event_id


class EmbeddedServerError(AgentCapStorageError):
    """The embedded PostgreSQL server could not be started, found or stopped."""
