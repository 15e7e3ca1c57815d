"""Run the web view under uvicorn, in the foreground (the command line) or in a thread (tests,
benchmarks), on a socket bound before the server starts so port 0 gives a free port."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import uvicorn

from otel_agentcap.tokens import is_loopback, require_token

from .app import LOOPBACK_HOSTS, ViewerConfig, create_app


def _bind(host: str, port: int) -> socket.socket:
    name = host.strip("[]")
    family = socket.AF_INET6 if ":" in name else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((name, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class ViewerServer:
    """The web view on ``host``:``port`` (port 0: any free port), serving ``config``.

    Bound to a non-loopback address it requires ``config.token`` (``TokenError`` otherwise) and
    accepts any ``Host`` header; bound to loopback it accepts only loopback host names."""

    def __init__(self, config: ViewerConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        require_token(host, config.token)
        if not is_loopback(host):
            config = replace(config, allowed_hosts=None)
        elif config.allowed_hosts is not None:  # e.g. 127.0.0.2: its own address is a host name
            config = replace(config, allowed_hosts=config.allowed_hosts | {host.strip("[]")})
        self.config = config
        self._socket = _bind(host, port)
        bound = self._socket.getsockname()
        self.host, self.port = bound[0], bound[1]
        uv_config = uvicorn.Config(
            create_app(config),
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(uv_config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve(self, on_ready: Callable[[ViewerServer], Any] | None = None) -> None:
        """Serve in this thread until interrupted (Ctrl-C) or :meth:`stop`."""
        if on_ready is not None:
            on_ready(self)
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._socket.close()

    def start(self) -> ViewerServer:
        """Serve in a daemon thread; returns once the server accepts requests."""
        self._thread = threading.Thread(target=self.serve, name="agentcap-ui", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the web view failed to start")
            self._thread.join(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["LOOPBACK_HOSTS", "ViewerConfig", "ViewerServer"]
