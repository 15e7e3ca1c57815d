"""One PostgreSQL database as the exporter and the sequence source share it: a connection pool,
opened without waiting (so configuration works while the server is still down), and the schema
migrated once, on first use."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Final

import psycopg
from psycopg_pool import ConnectionPool

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.errors import ConnectionFailed
from otel_agentcap.exporters.postgres.migrate import migrate

_logger = logging.getLogger(__name__)

ENV_DSN: Final = "AGENTCAP_DSN"


def resolve_dsn(dsn: str | None = None, *, announce: bool = True) -> str:
    """The DSN to use: the argument, else ``AGENTCAP_DSN``, else the embedded server (started or
    reused), whose location is printed to stderr when ``announce`` is true."""
    if dsn:
        return dsn
    env = os.environ.get(ENV_DSN)
    if env:
        return env
    resolved = embedded.start()
    if announce:
        print(
            f"otel-agentcap: using the embedded PostgreSQL in {embedded.default_data_dir()} "
            f"({resolved}); set {ENV_DSN} to use another server",
            file=sys.stderr,
        )
    return resolved


class Database:
    """A pool on ``dsn`` whose schema is migrated before first use."""

    def __init__(self, dsn: str, *, max_size: int = 4, name: str = "agentcap") -> None:
        self.dsn = dsn
        self.pool: ConnectionPool[Any] = ConnectionPool(
            dsn,
            min_size=1,
            max_size=max_size,
            open=False,
            name=name,
            kwargs={"autocommit": False},
            reconnect_timeout=0,  # never give up reconnecting; callers have their own timeouts
        )
        self.pool.open(wait=False)
        self._schema_ready = False
        self._lock = threading.Lock()

    def ensure_schema(self) -> None:
        """Migrate once per process; raises ConnectionFailed while the server is unreachable."""
        if self._schema_ready:
            return
        with self._lock:
            if self._schema_ready:
                return
            try:
                with psycopg.connect(self.dsn, connect_timeout=5, autocommit=True) as conn:
                    migrate(conn)
            except psycopg.OperationalError as exc:
                raise ConnectionFailed(f"cannot reach PostgreSQL: {exc}") from exc
            self._schema_ready = True

    def close(self) -> None:
        self.pool.close()
