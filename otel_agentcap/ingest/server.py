"""``OtlpIngestServer``: OTLP/HTTP (Starlette on Hypercorn, see :mod:`otel_agentcap.serving` for
why Hypercorn) and OTLP/gRPC (grpcio) receivers that store agentcap events in PostgreSQL.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_agentcap.exporters.postgres.database import Database, resolve_dsn
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult
from otel_agentcap.ingest.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    TRACES_PATH,
    IngestLimits,
    TlsConfig,
    exposure_warnings,
)
from otel_agentcap.ingest.grpc_server import GrpcReceiver
from otel_agentcap.ingest.http import build_app
from otel_agentcap.ingest.service import IngestService, IngestStats, Outcome
from otel_agentcap.ingest.wire import DecodedRequest, decode_protobuf
from otel_agentcap.serving import AsgiServer
from otel_agentcap.tokens import Authenticator

_logger = logging.getLogger(__name__)


class OtlpIngestServer:
    """OTLP trace receivers that store agentcap events in PostgreSQL.

    OTLP/HTTP on ``host:port`` (``port=0`` picks a free port, see :attr:`port` and
    :attr:`endpoint`); OTLP/gRPC on ``host:grpc_port`` when ``grpc_port`` is given. Spans are
    checked one by one and stored in chunks, deduplicated, so a collector may redeliver freely;
    see :mod:`otel_agentcap.ingest.http` for the answers. ``authenticator`` holds the bearer
    tokens (none: every request is accepted), ``tls`` the certificate, ``limits`` the bounds.

    Use it as a context manager, or :meth:`start` (background thread) and :meth:`close`, or
    :meth:`serve_forever` in the calling thread. Closing lets requests in progress finish (up to
    ``limits.graceful_timeout``).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        grpc_port: int | None = None,
        database: Database | None = None,
        path: str = TRACES_PATH,
        connect_timeout: float = 3.0,
        authenticator: Authenticator | None = None,
        tls: TlsConfig | None = None,
        limits: IngestLimits | None = None,
    ) -> None:
        if database is None and dsn is None:
            raise ValueError("give a dsn or a database")
        self.path = path
        self.host = host
        self.limits = limits or IngestLimits()
        self.tls = tls
        self.authenticator = authenticator or Authenticator()
        self._owns_database = database is None
        self._database = (
            database
            if database is not None
            else Database(str(dsn), name="ingest", lock_timeout=self.limits.lock_timeout)
        )
        self._writer = EventWriter(self._database.pool, connect_timeout=connect_timeout)
        self.service = IngestService(
            self._database,
            self._writer,
            chunk_spans=self.limits.chunk_spans,
            retry_after=self.limits.retry_after,
            max_writes=2 * self.limits.max_concurrent_requests,  # HTTP and gRPC
        )
        self._http = AsgiServer(
            lambda: build_app(self.service, self.authenticator, self.limits, self.path),
            host,
            port,
            name="ingest",
            limits=self.limits.connections,
            tls=tls,
            on_start=self._on_start,
            on_stop=self._on_stop,
        )
        self.port = self._http.port
        self._grpc: GrpcReceiver | None = None
        if grpc_port is not None:
            try:
                self._grpc = GrpcReceiver(
                    self.service, self.authenticator, self.limits, host, grpc_port, tls
                )
            except BaseException:
                self._http.close()
                raise
        self.grpc_port = self._grpc.port if self._grpc is not None else None
        self._closed = False

    # -- addresses and counters

    @property
    def endpoint(self) -> str:
        """The URL to POST traces to, e.g. ``http://127.0.0.1:4319/v1/traces``."""
        scheme = "https" if self.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}{self.path}"

    @property
    def grpc_endpoint(self) -> str | None:
        """``host:port`` of the OTLP/gRPC receiver, or None."""
        if self.grpc_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.grpc_port}"

    @property
    def database(self) -> Database:
        return self._database

    def stats(self) -> IngestStats:
        return self.service.stats()

    def warnings(self) -> list[str]:
        """What is unsafe about this configuration (listening beyond loopback without a token,
        or tokens without TLS there)."""
        return exposure_warnings(
            self.host, tokens=self.authenticator.enabled, tls=self.tls is not None
        )

    def process(self, request: DecodedRequest) -> Outcome:
        """Check and store a decoded request without any transport (as an anonymous sender)."""
        return self.service.process(request)

    def ingest(self, data: bytes | ExportTraceServiceRequest) -> WriteResult:
        """Check and store one OTLP request (its protobuf bytes) without any transport; what was
        stored. Raises ``DecodeError`` for bytes that are not a request, ``RetryLater`` when the
        database is unavailable; see :meth:`process` for the rejected spans."""
        if isinstance(data, ExportTraceServiceRequest):
            data = data.SerializeToString()
        return self.process(decode_protobuf(data, self.limits.max_spans)).result

    # -- serving

    def _on_start(self) -> None:
        # What is alive once serving starts (modules, descriptors, the pool) lives as long as the
        # server: keep it out of the collector's full passes, which would otherwise walk it
        # again and again while requests allocate.
        gc.collect()
        gc.freeze()
        if self._grpc is not None:
            self._grpc.start()

    def _on_stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(self.limits.graceful_timeout)

    def start(self) -> OtlpIngestServer:
        """Serve in a daemon thread; returns self once the receivers accept requests."""
        self._http.start()
        return self

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the calling thread until :meth:`close` is called from another thread, or
        SIGINT or SIGTERM arrives (in the main thread): then requests in progress finish."""
        self._http.serve_forever(on_ready)

    def close(self) -> None:
        """Stop accepting, let requests in progress finish, then close the writer's staging
        table and the pool if this server opened it."""
        if self._closed:
            return
        self._closed = True
        self._http.close()
        if self._grpc is not None and not self._http.started:
            self._grpc.stop(0)
        try:
            self.service.close()
            self._writer.close()
        finally:
            if self._owns_database:
                self._database.close()

    def __enter__(self) -> OtlpIngestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    dsn: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    on_ready: Callable[[OtlpIngestServer], None] | None = None,
    **options: Any,
) -> IngestStats:
    """Run an :class:`OtlpIngestServer` in the foreground until SIGINT or SIGTERM and return its
    counters. With no ``dsn``, ``AGENTCAP_DSN`` or the embedded PostgreSQL is used; ``options``
    are :class:`OtlpIngestServer`'s (``grpc_port``, ``authenticator``, ``tls``, ``limits``).
    ``on_ready`` is called with the listening server (default: log its endpoints and warnings)."""
    server = OtlpIngestServer(resolve_dsn(dsn), host=host, port=port, **options)

    def ready() -> None:
        if on_ready is not None:
            on_ready(server)
            return
        _logger.info("agentcap ingest: accepting OTLP/HTTP traces at %s", server.endpoint)
        for warning in server.warnings():
            _logger.warning("agentcap ingest: %s", warning)

    try:
        server.serve_forever(ready)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return server.stats()
