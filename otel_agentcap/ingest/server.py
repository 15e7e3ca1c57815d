"""``OtlpIngestServer``: OTLP/HTTP (Starlette on Hypercorn) and OTLP/gRPC (grpcio) receivers that
store agentcap events in PostgreSQL.

Hypercorn serves the HTTP side because it closes connections that stay idle, including new
connections that never send a complete request head (``keep_alive_timeout`` runs from the moment a
connection is accepted), and it bounds every read (``read_timeout``); uvicorn (0.54) arms its idle
timer only after a first response, so a connection that sends nothing, or a request head a byte
at a time, is held for ever. Both ship the same ASGI interface, so the application is Starlette
either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_agentcap.exporters.postgres.database import Database, resolve_dsn
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult
from otel_agentcap.ingest.auth import Authenticator
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

_logger = logging.getLogger(__name__)


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


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
        self._database = database if database is not None else Database(str(dsn), name="ingest")
        self._writer = EventWriter(self._database.pool, connect_timeout=connect_timeout)
        self.service = IngestService(
            self._database,
            self._writer,
            chunk_spans=self.limits.chunk_spans,
            retry_after=self.limits.retry_after,
            max_writes=2 * self.limits.max_concurrent_requests,  # HTTP and gRPC
        )
        self._socket: socket.socket | None = _listen(host, port, 128)
        self.port = int(self._socket.getsockname()[1])
        self._grpc: GrpcReceiver | None = None
        if grpc_port is not None:
            try:
                self._grpc = GrpcReceiver(
                    self.service, self.authenticator, self.limits, host, grpc_port, tls
                )
            except BaseException:
                self._socket.close()
                raise
        self.grpc_port = self._grpc.port if self._grpc is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
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
        return self.process(decode_protobuf(data)).result

    # -- serving

    def _hypercorn_config(self, sock: socket.socket) -> HypercornConfig:
        limits = self.limits
        config = HypercornConfig()
        config.bind = [f"fd://{sock.detach()}"]
        config.keep_alive_timeout = limits.idle_timeout
        config.read_timeout = max(1, round(limits.read_timeout))
        config.graceful_timeout = limits.graceful_timeout
        config.h11_max_incomplete_size = limits.max_header_bytes
        config.h2_max_concurrent_streams = limits.max_streams_per_connection
        config.h2_max_header_list_size = limits.max_header_bytes
        config.include_server_header = False
        config.accesslog = None
        config.errorlog = logging.getLogger("otel_agentcap.ingest.hypercorn")
        if self.tls is not None:
            config.certfile = self.tls.certfile
            config.keyfile = self.tls.keyfile
            if self.tls.client_ca is not None:
                config.ca_certs = self.tls.client_ca
                config.verify_mode = ssl.CERT_REQUIRED
        return config

    async def _serve(self, on_ready: Callable[[], None]) -> None:
        sock = self._socket
        if sock is None:
            raise RuntimeError("this server was closed")
        self._socket = None
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        app = build_app(self.service, self.authenticator, self.limits, self.path)
        config = self._hypercorn_config(sock)
        # What is alive once serving starts (modules, descriptors, the pool) lives as long as the
        # server: keep it out of the collector's full passes, which would otherwise walk it
        # again and again while requests allocate.
        gc.collect()
        gc.freeze()
        if self._grpc is not None:
            self._grpc.start()
        on_ready()
        self._ready.set()
        try:
            await hypercorn_serve(app, config, shutdown_trigger=self._shutdown.wait)  # type: ignore[arg-type]
        finally:
            if self._grpc is not None:
                await asyncio.to_thread(self._grpc.stop, self.limits.graceful_timeout)
            self._stopped.set()

    def start(self) -> OtlpIngestServer:
        """Serve in a daemon thread; returns self once the receivers accept requests."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=lambda: asyncio.run(self._serve(lambda: None)),
                name="agentcap-otlp-ingest",
                daemon=True,
            )
            self._thread.start()
            if not self._ready.wait(30):
                raise RuntimeError("the ingest server did not start")
        return self

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the calling thread until :meth:`close` is called from another thread, or
        SIGINT or SIGTERM arrives (in the main thread): then requests in progress finish."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            installed: list[signal.Signals] = []
            if threading.current_thread() is threading.main_thread():
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(signum, self._request_shutdown)
                    installed.append(signum)
            try:
                await self._serve(on_ready or (lambda: None))
            finally:
                for signum in installed:
                    loop.remove_signal_handler(signum)

        asyncio.run(main())

    def _request_shutdown(self) -> None:
        if self._shutdown is not None:
            self._shutdown.set()

    def close(self) -> None:
        """Stop accepting, let requests in progress finish, then close the writer's staging
        table and the pool if this server opened it."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is not None and self._ready.is_set() and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(self._request_shutdown)
            self._stopped.wait(self.limits.graceful_timeout + 15)
        if self._thread is not None:
            self._thread.join(timeout=self.limits.graceful_timeout + 15)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._grpc is not None and not self._ready.is_set():
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
