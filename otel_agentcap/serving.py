"""Serving an ASGI application over HTTP with Hypercorn: the OTLP ingest and the web view.

Hypercorn serves both because it closes connections that stay idle, including new connections that
never send a complete request head (``keep_alive_timeout`` runs from the moment a connection is
accepted), and it bounds every read (``read_timeout``); uvicorn (0.54) arms its idle timer only
after a first response, so a connection that sends nothing, or a request head a byte at a time, is
held for ever.

The socket is bound when the server is created, so port 0 gives a free port (:attr:`AsgiServer.port`)
and an address in use is an error before anything runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

#: A connection with no request in progress (fresh, or kept alive) is closed after this.
DEFAULT_IDLE_TIMEOUT: Final = 30.0
#: One read from a connection that waits longer than this closes it.
DEFAULT_READ_TIMEOUT: Final = 30.0


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` keeps a server reachable from this machine only."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` (an IPv6 address with or without brackets)."""
    name = host.strip("[]")
    family = socket.AF_INET6 if ":" in name else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((name, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Serve over TLS with this certificate chain and key (PEM files); with ``client_ca``, ask
    clients for a certificate signed by it (mutual TLS) and refuse those without."""

    certfile: str
    keyfile: str
    client_ca: str | None = None


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How long a connection may stay idle or wait on a read, how long shutdown waits for requests
    in progress, and how large a request head may be."""

    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    graceful_timeout: float = 30.0
    max_header_bytes: int = 64 * 1024
    #: HTTP/2 streams per connection.
    max_streams_per_connection: int = 16

    def __post_init__(self) -> None:
        for name in ("idle_timeout", "read_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def hypercorn_config(
    sock: socket.socket, limits: ConnectionLimits, tls: TlsConfig | None, log_name: str
) -> HypercornConfig:
    """Hypercorn's settings to serve on ``sock`` (which it takes over) within ``limits``."""
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
    config.errorlog = logging.getLogger(log_name)
    if tls is not None:
        config.certfile = tls.certfile
        config.keyfile = tls.keyfile
        if tls.client_ca is not None:
            config.ca_certs = tls.client_ca
            config.verify_mode = ssl.CERT_REQUIRED
    return config


class AsgiServer:
    """The ASGI application ``app_factory()`` served by Hypercorn on ``host``:``port``.

    :meth:`start` serves in a daemon thread and returns once the server accepts connections;
    :meth:`serve_forever` serves in the calling thread until :meth:`close` is called from another
    thread or, in the main thread, SIGINT or SIGTERM arrives. Either way, stopping closes the
    listening socket and lets requests in progress finish (up to ``limits.graceful_timeout``).
    ``on_start`` runs in the server's event loop before it serves, ``on_stop`` in a worker
    thread once it has stopped serving.
    """

    def __init__(
        self,
        app_factory: Callable[[], Any],
        host: str,
        port: int,
        *,
        name: str,
        limits: ConnectionLimits | None = None,
        tls: TlsConfig | None = None,
        on_start: Callable[[], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.limits = limits or ConnectionLimits()
        self.tls = tls
        self._app_factory = app_factory
        self._on_start = on_start
        self._on_stop = on_stop
        self._socket: socket.socket | None = listen(host, port)
        bound = self._socket.getsockname()
        self.host: str = host
        self.port: int = int(bound[1])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._closed = False

    @property
    def started(self) -> bool:
        """Whether the server has started serving (and may still be)."""
        return self._ready.is_set()

    async def _serve(self, on_ready: Callable[[], None]) -> None:
        sock = self._socket
        if sock is None or self._closed:
            raise RuntimeError(f"the {self.name} server was closed")
        self._socket = None
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        try:
            app = self._app_factory()
            config = hypercorn_config(sock, self.limits, self.tls, f"otel_agentcap.{self.name}")
            if self._on_start is not None:
                self._on_start()
            on_ready()
            self._ready.set()
            await hypercorn_serve(app, config, shutdown_trigger=self._shutdown.wait)
        finally:
            with contextlib.suppress(OSError):
                sock.close()  # detached into Hypercorn's config unless something failed first
            if self._on_stop is not None:
                await asyncio.to_thread(self._on_stop)
            self._stopped.set()

    def start(self, timeout: float = 30.0) -> None:
        """Serve in a daemon thread; return once the server accepts connections."""
        if self._thread is not None:
            return
        failure: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._serve(lambda: None))
            except BaseException as exc:
                failure.append(exc)
                raise

        self._thread = threading.Thread(target=run, name=f"agentcap-{self.name}", daemon=True)
        self._thread.start()
        waited = 0.0
        while not self._ready.wait(0.05):
            waited += 0.05
            if not self._thread.is_alive() or waited >= timeout:
                detail = f": {failure[0]!r}" if failure else ""
                raise RuntimeError(f"the {self.name} server did not start{detail}")

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
        """Stop accepting and let requests in progress finish (up to the graceful timeout); a
        server that never served closes its socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        wait = self.limits.graceful_timeout + 15
        loop = self._loop
        if loop is not None and self._ready.is_set() and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(self._request_shutdown)
            self._stopped.wait(wait)
        if self._thread is not None:
            self._thread.join(timeout=wait)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
