"""OTLP ingest: turn OTLP trace requests into agentcap events, and a small OTLP/HTTP receiver.

:func:`spans_from_otlp` is pure: it converts an ``ExportTraceServiceRequest`` (or its serialized
protobuf bytes) into :class:`OtlpSpan` objects that satisfy :class:`otel_agentcap.mapping.SpanLike`,
so ``batch_from_spans(spans_from_otlp(request))`` yields the same events, agents and runs as
mapping the SDK spans the request was encoded from (in the request's span order).

:class:`OtlpIngestServer` accepts OTLP/HTTP protobuf POSTs on ``/v1/traces`` (plain or gzip), maps
each request to one batch and stores it with an :class:`EventWriter`. Events already stored (a
collector redelivering a request it could not see acknowledged) are counted as duplicates, never
stored twice. A failed write answers 503, which OTLP senders retry; a request that can never be
stored (undecodable body, a batch the database rejects) answers 400, which they drop.
"""

from __future__ import annotations

import importlib
import logging
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_agentcap.exporters.postgres.database import Database, resolve_dsn
from otel_agentcap.exporters.postgres.errors import AgentCapStorageError
from otel_agentcap.exporters.postgres.exporter import write_spans
from otel_agentcap.exporters.postgres.writer import EventWriter, WriteResult

_logger = logging.getLogger(__name__)

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 4319
"""Default port of the ingest server (4317 and 4318 are the collector's own OTLP receivers)."""
TRACES_PATH: Final = "/v1/traces"
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""Largest request body accepted, after decompression."""

_PROTOBUF: Final = "application/x-protobuf"
# google.protobuf ships no type stubs; its DecodeError is all this module needs of it directly.
_DecodeError: type[Exception] = importlib.import_module("google.protobuf.message").DecodeError

# OTLP span kinds are the API's plus one (0 is SPAN_KIND_UNSPECIFIED, read as INTERNAL).
_KINDS: Final = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: SpanKind.INTERNAL,
    trace_pb2.Span.SPAN_KIND_SERVER: SpanKind.SERVER,
    trace_pb2.Span.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    trace_pb2.Span.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    trace_pb2.Span.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}


# --- conversion -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OtlpSpanContext:
    """Trace and span id of a span, as the integers the SDK's ``SpanContext`` holds."""

    trace_id: int
    span_id: int


@dataclass(frozen=True, slots=True)
class OtlpSpanEvent:
    """An event inside a span (``Span.Event``)."""

    name: str
    attributes: Mapping[str, Any]
    timestamp: int


@dataclass(frozen=True, slots=True)
class OtlpScope:
    """The instrumentation scope that recorded a span."""

    name: str
    version: str | None = None


@dataclass(frozen=True, slots=True)
class OtlpSpan:
    """One span of an OTLP request, shaped like the parts of an SDK ``ReadableSpan`` that
    :mod:`otel_agentcap.mapping` reads (it satisfies ``mapping.SpanLike``)."""

    name: str
    context: OtlpSpanContext
    parent: OtlpSpanContext | None
    kind: SpanKind
    attributes: Mapping[str, Any]
    events: tuple[OtlpSpanEvent, ...]
    start_time: int | None
    end_time: int | None
    status: Status
    instrumentation_scope: OtlpScope
    resource_attributes: Mapping[str, Any] = field(default_factory=dict)


def decode_value(value: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as the Python value the SDK recorded: arrays become tuples (as the
    SDK stores sequences), key-value lists dicts, an empty value ``None``."""
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return value.bool_value
    if which == "int_value":
        return value.int_value
    if which == "double_value":
        return value.double_value
    if which == "bytes_value":
        return value.bytes_value
    if which == "array_value":
        return tuple(decode_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return decode_attributes(value.kvlist_value.values)
    return None  # unset, or a string-table index (profiles only), which traces never use


def decode_attributes(values: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP key-values as a dict; a repeated key keeps its last value, as the SDK would."""
    return {kv.key: decode_value(kv.value) for kv in values}


def _span_context(trace_id: bytes, span_id: bytes) -> OtlpSpanContext | None:
    if not trace_id or not span_id:
        return None
    return OtlpSpanContext(int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"))


def _status(status: trace_pb2.Status) -> Status:
    code = StatusCode(status.code) if status.code in (0, 1, 2) else StatusCode.UNSET
    # The API allows a description only with ERROR.
    description = (status.message or None) if code is StatusCode.ERROR else None
    return Status(code, description)


def _span(span: trace_pb2.Span, scope: OtlpScope, resource: Mapping[str, Any]) -> OtlpSpan | None:
    context = _span_context(span.trace_id, span.span_id)
    if context is None:
        return None  # invalid ids: no SDK span has them, and the mapping would misreport them
    return OtlpSpan(
        name=span.name,
        context=context,
        parent=_span_context(span.trace_id, span.parent_span_id),
        kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
        attributes=decode_attributes(span.attributes),
        events=tuple(
            OtlpSpanEvent(e.name, decode_attributes(e.attributes), e.time_unix_nano)
            for e in span.events
        ),
        start_time=span.start_time_unix_nano or None,
        end_time=span.end_time_unix_nano or None,
        status=_status(span.status),
        instrumentation_scope=scope,
        resource_attributes=resource,
    )


def parse_request(data: bytes | ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """The request itself, or the request serialized in ``data``; raises
    ``google.protobuf.message.DecodeError`` on bytes that are not one."""
    if isinstance(data, ExportTraceServiceRequest):
        return data
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return request


def iter_spans(data: bytes | ExportTraceServiceRequest) -> Iterator[OtlpSpan]:
    """The spans of an OTLP trace request, in request order; spans without valid ids are skipped."""
    request = parse_request(data)
    for resource_spans in request.resource_spans:
        resource = decode_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = OtlpScope(scope_spans.scope.name, scope_spans.scope.version or None)
            for span in scope_spans.spans:
                converted = _span(span, scope, resource)
                if converted is not None:
                    yield converted


def spans_from_otlp(data: bytes | ExportTraceServiceRequest) -> list[OtlpSpan]:
    """The spans of an OTLP ``ExportTraceServiceRequest`` (or its protobuf bytes) as objects the
    agentcap mapping reads like SDK spans: ``batch_from_spans(spans_from_otlp(request))``."""
    return list(iter_spans(data))


# --- OTLP/HTTP receiver -----------------------------------------------------------------------


@dataclass
class IngestStats:
    """Counters of an :class:`OtlpIngestServer`; read them with :meth:`OtlpIngestServer.stats`."""

    requests: int = 0
    batches: int = 0
    events_inserted: int = 0
    duplicates: int = 0
    conflicts: int = 0
    rejected_requests: int = 0
    """Answered 4xx: undecodable, unsupported, or a batch the database can never store."""
    failed_requests: int = 0
    """Answered 503: the write failed and the sender should retry."""


class _RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _rpc_status(code: int, message: str) -> bytes:
    """A serialized ``google.rpc.Status`` (code, message), the body OTLP/HTTP error answers carry."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte = n & 0x7F
            n >>= 7
            if n:
                out.append(byte | 0x80)
            else:
                out.append(byte)
                return bytes(out)

    text = message.encode("utf-8", "replace")[:4096]
    return b"\x08" + varint(code) + b"\x12" + varint(len(text)) + text


# gRPC codes for the error bodies (google.rpc.Code).
_RPC_CODES: Final = {
    HTTPStatus.BAD_REQUEST: 3,  # INVALID_ARGUMENT
    HTTPStatus.NOT_FOUND: 5,  # NOT_FOUND
    HTTPStatus.METHOD_NOT_ALLOWED: 12,  # UNIMPLEMENTED
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: 8,  # RESOURCE_EXHAUSTED
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: 3,
    HTTPStatus.INTERNAL_SERVER_ERROR: 13,  # INTERNAL
    HTTPStatus.SERVICE_UNAVAILABLE: 14,  # UNAVAILABLE
}


def _gunzip(data: bytes, limit: int) -> bytes:
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = decompressor.decompress(data, limit)
    except zlib.error as exc:
        raise _RequestError(HTTPStatus.BAD_REQUEST, f"invalid gzip body: {exc}") from exc
    if decompressor.unconsumed_tail:
        raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as collectors expect
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        _logger.debug("agentcap ingest: " + format, *args)

    def do_POST(self) -> None:
        try:
            if self.path.split("?", 1)[0] != self.server.ingest.path:
                self._drain()
                raise _RequestError(HTTPStatus.NOT_FOUND, f"no such path: {self.path}")
            body = self._body()
            status, payload = self.server.ingest.handle(body)
        except _RequestError as exc:
            self.server.ingest.count_rejected()
            self._error(exc.status, str(exc))
            return
        self._reply(status, _PROTOBUF, payload)

    def do_GET(self) -> None:
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "POST OTLP/HTTP protobuf to " + TRACES_PATH)

    def _drain(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)
        else:
            self.close_connection = True

    def _read_raw(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            total = 0
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY_BYTES:
                    self.close_connection = True
                    raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError as exc:
            self.close_connection = True
            raise _RequestError(HTTPStatus.BAD_REQUEST, "invalid Content-Length") from exc
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
        return self.rfile.read(length) if length > 0 else b""

    def _body(self) -> bytes:
        raw = self._read_raw()
        content_type = self.headers.get("Content-Type", _PROTOBUF).split(";", 1)[0].strip()
        if content_type.lower() != _PROTOBUF:
            raise _RequestError(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"unsupported Content-Type {content_type!r}; send {_PROTOBUF}",
            )
        encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return raw
        if encoding in ("gzip", "x-gzip"):
            return _gunzip(raw, MAX_BODY_BYTES)
        raise _RequestError(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"unsupported Content-Encoding {encoding!r}"
        )

    def _error(self, status: HTTPStatus, message: str) -> None:
        body = _rpc_status(_RPC_CODES.get(status, 2), message)
        self._reply(status, _PROTOBUF, body)

    def _reply(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status is HTTPStatus.SERVICE_UNAVAILABLE:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(body)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], ingest: OtlpIngestServer) -> None:
        self.ingest = ingest
        super().__init__(address, _Handler)


class OtlpIngestServer:
    """An OTLP/HTTP trace receiver that stores agentcap events in PostgreSQL.

    ``port=0`` picks a free port (see :attr:`port` and :attr:`endpoint`). Each request is one
    batch, written in one transaction; events already stored are counted as duplicates, so a
    collector may redeliver freely. Answers: 200 with an empty ``ExportTraceServiceResponse``
    when stored; 503 (retry) when the write failed for a reason that may pass (database down,
    contention); 400 when the request or its batch can never be stored.

    Use it as a context manager, or :meth:`start` (background thread) and :meth:`close`, or
    :meth:`serve_forever` in the calling thread.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        database: Database | None = None,
        path: str = TRACES_PATH,
        connect_timeout: float = 3.0,
    ) -> None:
        if database is None and dsn is None:
            raise ValueError("give a dsn or a database")
        self.path = path
        self._owns_database = database is None
        self._database = database if database is not None else Database(str(dsn), name="ingest")
        self._writer = EventWriter(self._database.pool, connect_timeout=connect_timeout)
        self._stats = IngestStats()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()
        self._httpd = _HTTPServer((host, port), self)

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def endpoint(self) -> str:
        """The URL to POST traces to, e.g. ``http://127.0.0.1:4319/v1/traces``."""
        return f"http://{self.host}:{self.port}{self.path}"

    @property
    def database(self) -> Database:
        return self._database

    def stats(self) -> IngestStats:
        with self._lock:
            return IngestStats(**asdict(self._stats))

    def count_rejected(self) -> None:
        with self._lock:
            self._stats.requests += 1
            self._stats.rejected_requests += 1

    def ingest(self, data: bytes | ExportTraceServiceRequest) -> WriteResult:
        """Map one OTLP request and store it (no HTTP); raises ``DecodeError`` on an undecodable
        body and ``AgentCapStorageError`` when the write fails."""
        return write_spans(self._database, self._writer, list(iter_spans(data)))

    def handle(self, body: bytes) -> tuple[HTTPStatus, bytes]:
        """The HTTP status and body answering a request whose (decompressed) body is ``body``."""
        try:
            result = self.ingest(body)
        except _DecodeError as exc:
            raise _RequestError(
                HTTPStatus.BAD_REQUEST, f"not an OTLP trace request: {exc}"
            ) from exc
        except AgentCapStorageError as exc:
            with self._lock:
                self._stats.requests += 1
                if exc.retryable:
                    self._stats.failed_requests += 1
                else:
                    self._stats.rejected_requests += 1
            if exc.retryable:
                _logger.warning(
                    "agentcap ingest: write failed, asking the sender to retry: %s", exc
                )
                return HTTPStatus.SERVICE_UNAVAILABLE, _rpc_status(14, str(exc))
            _logger.error("agentcap ingest: batch can never be stored, rejected: %s", exc)
            return HTTPStatus.BAD_REQUEST, _rpc_status(3, str(exc))
        except Exception as exc:  # a bug of ours: let the sender retry rather than lose the data
            _logger.exception("agentcap ingest: request failed unexpectedly")
            with self._lock:
                self._stats.requests += 1
                self._stats.failed_requests += 1
            return HTTPStatus.SERVICE_UNAVAILABLE, _rpc_status(13, repr(exc))
        with self._lock:
            self._stats.requests += 1
            if result.attempts:
                self._stats.batches += 1
            self._stats.events_inserted += result.inserted
            self._stats.duplicates += result.duplicates
            self._stats.conflicts += result.conflicts
        if result.conflicts:
            _logger.error(
                "agentcap ingest: %d events collided with different stored events; kept in "
                "agentcap.conflicts",
                result.conflicts,
            )
        return HTTPStatus.OK, ExportTraceServiceResponse().SerializeToString()

    def start(self) -> OtlpIngestServer:
        """Serve in a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.serve_forever, name="agentcap-otlp-ingest", daemon=True
            )
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until :meth:`close` is called from another thread."""
        self._serving.set()
        try:
            self._httpd.serve_forever()
        finally:
            self._serving.clear()

    def close(self) -> None:
        """Stop serving, drop the writer's staging table, close the pool if this server opened it."""
        if self._serving.is_set():
            self._httpd.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()
        try:
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
) -> IngestStats:
    """Run an :class:`OtlpIngestServer` in the foreground until interrupted (Ctrl-C) and return
    its counters. With no ``dsn``, ``AGENTCAP_DSN`` or the embedded PostgreSQL is used.
    ``on_ready`` is called with the listening server (default: log its endpoint)."""
    server = OtlpIngestServer(resolve_dsn(dsn), host=host, port=port)
    if on_ready is None:
        _logger.info("agentcap ingest: accepting OTLP/HTTP traces at %s", server.endpoint)
    else:
        on_ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return server.stats()
