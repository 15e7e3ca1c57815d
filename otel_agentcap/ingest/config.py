"""Settings of the OTLP ingest server: limits, timeouts, TLS (``TlsConfig``, shared with the
web view)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from otel_agentcap.exporters.postgres.store import INGEST_LOCK_TIMEOUT
from otel_agentcap.serving import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    ConnectionLimits,
    TlsConfig,
    is_loopback,
)
from otel_agentcap.tokens import INGEST_TOKENS_ENV

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 4319
"""Default OTLP/HTTP port of the ingest (4317 and 4318 are the collector's own receivers)."""
TRACES_PATH: Final = "/v1/traces"
MiB: Final = 1024 * 1024


@dataclass(frozen=True, slots=True)
class IngestLimits:
    """Bounds on what one ingest process accepts and holds.

    Memory: a request holds at most its body (``max_body_bytes`` after decompression, OTLP/JSON
    ``max_json_body_bytes``) plus one chunk of mapped spans (an OTLP/JSON request also its
    decoded form, at most ``max_json_memory``: ``2 x max_body_bytes``), and at most
    ``max_concurrent_requests`` requests per transport are read and processed at once; others
    wait up to ``queue_timeout`` seconds without their bodies being read, then get 503
    (``Retry-After``). So the ingest holds about ``2 x max_concurrent_requests x max_body_bytes``
    at most per transport (HTTP and gRPC), whatever the number of connections and the shape of
    the requests.
    """

    max_body_bytes: int = 64 * MiB
    #: Spans one request may hold (and resources, scopes and other entries around them): what
    #: a request costs in CPU grows with its entries, two bytes each at least, not with its
    #: size. A request of more is refused whole (413; gRPC RESOURCE_EXHAUSTED, not retried).
    max_spans: int = 100_000
    #: OTLP/JSON is parsed whole, into Python objects: 6 times its size for ordinary spans, up to
    #: 45 times for dense shapes (see ``max_json_memory``). A smaller limit.
    max_json_body_bytes: int = 16 * MiB
    max_concurrent_requests: int = 4
    queue_timeout: float = 10.0
    #: A connection with no request in progress (fresh, or kept alive) is closed after this.
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    #: One read from a connection that waits longer than this closes it.
    read_timeout: float = DEFAULT_READ_TIMEOUT
    #: The whole body of a request must arrive within this (a slow sender gets 408).
    body_timeout: float = 120.0
    #: On shutdown, requests in progress get this long to finish.
    graceful_timeout: float = 30.0
    #: Largest request head (line and headers).
    max_header_bytes: int = 64 * 1024
    #: HTTP/2 streams per connection, gRPC streams per connection.
    max_streams_per_connection: int = 16
    #: Spans mapped and stored per transaction; a request of more is pipelined (the next chunk is
    #: decoded and mapped while one is written). Smaller chunks cost a transaction each.
    chunk_spans: int = 2_000
    #: Seconds a sender is asked to wait when the event log is unavailable.
    retry_after: int = 5
    #: Seconds a write waits for a lock another session holds on the log (a migration, other
    #: DDL, a ``LOCK TABLE``) before the request is answered "retry later" (503 with
    #: ``Retry-After``; gRPC ``UNAVAILABLE`` with ``RetryInfo``); 0 waits without limit. Applies
    #: to the database the server opens (a ``Database`` given to it keeps its own setting).
    lock_timeout: float = INGEST_LOCK_TIMEOUT

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_json_body_bytes",
            "max_concurrent_requests",
            "max_spans",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("queue_timeout", "idle_timeout", "read_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.lock_timeout < 0:
            raise ValueError("lock_timeout must not be negative")

    @property
    def max_json_memory(self) -> int:
        """What the decoded form of one OTLP/JSON request may take, bounded from above before it
        is parsed (``wire.json_memory_bound``): ``2 x max_body_bytes``, what a protobuf request
        holds at most. A body that could take more is refused (413): ordinary spans up to about
        ``max_body_bytes / 8`` of JSON pass, dense shapes (arrays of tiny objects, nesting) less."""
        return 2 * self.max_body_bytes

    @property
    def connections(self) -> ConnectionLimits:
        """The limits of the HTTP server's connections."""
        return ConnectionLimits(
            idle_timeout=self.idle_timeout,
            read_timeout=self.read_timeout,
            graceful_timeout=self.graceful_timeout,
            max_header_bytes=self.max_header_bytes,
            max_streams_per_connection=self.max_streams_per_connection,
        )


def exposure_warnings(host: str, *, tokens: bool, tls: bool) -> list[str]:
    """What is unsafe about listening on ``host`` this way: beyond loopback without a bearer
    token, or with tokens but without TLS."""
    if is_loopback(host):
        return []
    if not tokens:
        return [
            f"listening on {host}, beyond loopback, without a bearer token: anyone who can reach "
            f"it can write to the event log (give --token-file or {INGEST_TOKENS_ENV})"
        ]
    if not tls:
        return [
            f"listening on {host}, beyond loopback, without TLS: bearer tokens and spans travel "
            "in clear text (give --tls-cert and --tls-key)"
        ]
    return []


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TRACES_PATH",
    "IngestLimits",
    "TlsConfig",
    "exposure_warnings",
]
