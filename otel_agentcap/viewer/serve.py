"""Run the web view under Hypercorn (see :mod:`otel_agentcap.serving`), in the foreground (the
command line) or in a thread (tests, benchmarks), on a socket bound before the server starts so
port 0 gives a free port."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from otel_agentcap.serving import AsgiServer, ConnectionLimits, is_loopback
from otel_agentcap.tokens import UI_TOKENS_ENV, TokenConfigError

from .app import LOOPBACK_HOSTS, ViewerConfig, create_app

#: Requests of the view are short queries (30 s statement timeout): shutdown waits this long.
GRACEFUL_TIMEOUT = 5.0


class ViewerServer:
    """The web view on ``host``:``port`` (port 0: any free port), serving ``config``.

    Bound to a non-loopback address it requires tokens in ``config.authenticator``
    (``TokenConfigError`` otherwise) and accepts any ``Host`` header; bound to loopback it accepts
    only loopback host names. Connections are closed when idle or slow as the ingest's are
    (``limits``: 30 s each by default)."""

    def __init__(
        self,
        config: ViewerConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ConnectionLimits | None = None,
    ) -> None:
        if not is_loopback(host):
            if not config.authenticator.enabled:
                raise TokenConfigError(
                    f"binding to {host} exposes the event log beyond this machine: give tokens "
                    f"with --token-file or ${UI_TOKENS_ENV}"
                )
            config = replace(config, allowed_hosts=None)
        elif config.allowed_hosts is not None:  # e.g. 127.0.0.2: its own address is a host name
            config = replace(config, allowed_hosts=config.allowed_hosts | {host.strip("[]")})
        self.config = config
        self._server = AsgiServer(
            lambda: create_app(config),
            host,
            port,
            name="ui",
            limits=limits or ConnectionLimits(graceful_timeout=GRACEFUL_TIMEOUT),
            tls=config.tls,
        )
        self.host = host.strip("[]")
        self.port = self._server.port

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def warnings(self) -> list[str]:
        """What is unsafe about this configuration: tokens sent in clear text beyond loopback."""
        if is_loopback(self.host) or self.config.tls is not None:
            return []
        return [
            f"listening on {self.host}, beyond loopback, without TLS: bearer tokens, the login "
            "cookie and the log's contents travel in clear text (give --tls-cert and --tls-key)"
        ]

    def serve(self, on_ready: Callable[[ViewerServer], Any] | None = None) -> None:
        """Serve in this thread until interrupted (Ctrl-C, SIGTERM) or :meth:`stop`;
        ``on_ready`` is called with the server once it accepts requests."""
        try:
            self._server.serve_forever(None if on_ready is None else lambda: on_ready(self))
        finally:
            self._server.close()

    def start(self) -> ViewerServer:
        """Serve in a daemon thread; returns once the server accepts requests."""
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.close()

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["LOOPBACK_HOSTS", "ViewerConfig", "ViewerServer"]
