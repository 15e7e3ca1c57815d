"""The OTLP/gRPC receiver: ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on
grpcio.

The request bytes are decoded span by span (``wire.decode_protobuf``), as on OTLP/HTTP. Answers,
as the OTLP specification defines them: OK with an ``ExportTraceServiceResponse`` whose
``partial_success`` holds the rejected spans and why; ``UNAVAILABLE`` with a ``RetryInfo`` when the
event log is unavailable (retried); ``INVALID_ARGUMENT`` for a request that is not an OTLP trace
request, ``UNAUTHENTICATED`` for a missing or wrong bearer token (``authorization`` metadata),
``RESOURCE_EXHAUSTED`` (from grpcio) for a message over the limit, also after decompression, and
(without ``RetryInfo``, so not retried) for a request of more than ``max_spans`` spans.

Limits: a call reads its message only once it holds one of ``max_concurrent_requests``
processing slots (the method is served as client-streaming, so grpcio does not read the message
before the handler asks for it), so at most that many messages are held at once. Other calls wait
for a slot up to ``queue_timeout``, then fail ``UNAVAILABLE`` with a ``RetryInfo`` (retried, as
the 503 of OTLP/HTTP): never grpcio's ``RESOURCE_EXHAUSTED`` without one, which OTLP senders
(the collector) treat as permanent and drop. Up to ``8 x max_concurrent_requests`` calls wait in
threads; more wait for a thread, up to ``64 x max_concurrent_requests`` calls in all (beyond that,
grpcio's own limit answers ``RESOURCE_EXHAUSTED``). A message must arrive within
``body_timeout`` once its call holds a slot, or the call is cancelled (the sender sees
``CANCELLED``, which it retries). Idle connections are closed after ``idle_timeout``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from otel_agentcap.ingest.config import IngestLimits, TlsConfig
from otel_agentcap.ingest.service import IngestService, RetryLater
from otel_agentcap.ingest.wire import DecodeError, TooManySpans, decode_protobuf
from otel_agentcap.tokens import Authenticator, Principal

_logger = logging.getLogger(__name__)

SERVICE: Final = "opentelemetry.proto.collector.trace.v1.TraceService"
METHOD: Final = f"/{SERVICE}/Export"


class _Status(grpc.Status):
    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing_metadata: tuple[tuple[str, bytes], ...],
    ) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


def _retry_status(message: str, retry_after: int) -> _Status:
    """UNAVAILABLE with a ``google.rpc.RetryInfo`` detail, as OTLP asks for throttling."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry_after)))
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message, details=[detail])
    return _Status(
        grpc.StatusCode.UNAVAILABLE,
        message,
        (("grpc-status-details-bin", status.SerializeToString()),),
    )


class GrpcReceiver:
    """A grpcio server bound to ``host:port`` (0: a free port, see :attr:`port`)."""

    def __init__(
        self,
        service: IngestService,
        authenticator: Authenticator,
        limits: IngestLimits,
        host: str,
        port: int,
        tls: TlsConfig | None = None,
    ) -> None:
        self._service = service
        self._authenticator = authenticator
        self._limits = limits
        workers = limits.max_concurrent_requests
        self._slots = threading.BoundedSemaphore(workers)
        # Client-streaming on the server side (the same call on the wire as a unary one): the
        # message is read when the handler asks for it, once it holds a slot.
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {"Export": grpc.stream_unary_rpc_method_handler(self._export)},
        )
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=8 * workers, thread_name_prefix="agentcap-ingest-grpc"),
            handlers=[handler],
            options=[
                ("grpc.max_receive_message_length", limits.max_body_bytes),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
                ("grpc.max_connection_idle_ms", int(limits.idle_timeout * 1000)),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=64 * workers,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls is None:
            bound = self._server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(Path(tls.keyfile).read_bytes(), Path(tls.certfile).read_bytes())],
                root_certificates=Path(tls.client_ca).read_bytes() if tls.client_ca else None,
                require_client_auth=tls.client_ca is not None,
            )
            bound = self._server.add_secure_port(address, credentials)
        if not bound:
            raise OSError(f"cannot listen for OTLP/gRPC on {address}")
        self.port = bound

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float) -> None:
        """Refuse new calls, let calls in progress finish for up to ``grace`` seconds."""
        self._server.stop(grace).wait(grace + 5)

    def _abort(
        self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str
    ) -> NoReturn:
        context.abort(code, message)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def _export(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        service = self._service
        service.count(requests=1)
        metadata: dict[str, Any] = {k: v for k, v in context.invocation_metadata()}
        principal = self._authenticator.authenticate(metadata.get("authorization"))
        if principal is None:
            service.count(rejected_requests=1, unauthorized_requests=1)
            self._abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if not self._slots.acquire(timeout=self._limits.queue_timeout):
            service.count(failed_requests=1)
            _logger.warning("agentcap ingest: saturated, asking a gRPC sender to retry")
            context.abort_with_status(_retry_status("the ingest is saturated; retry later", 1))
            raise AssertionError("unreachable")  # pragma: no cover - abort raises
        try:
            return self._export_in_slot(requests, context, principal)
        finally:
            self._slots.release()

    def _export_in_slot(
        self, requests: Iterator[bytes], context: grpc.ServicerContext, principal: Principal
    ) -> bytes:
        service = self._service
        # A message that does not arrive in time ends the call (a cancelled call stops the wait;
        # the sender sees CANCELLED): a slow sender cannot hold a slot, as on OTLP/HTTP (408).
        late = threading.Event()

        def cut() -> None:
            late.set()
            context.cancel()

        timer = threading.Timer(self._limits.body_timeout, cut)
        timer.daemon = True
        timer.start()
        try:
            request = next(requests, None)
        except grpc.RpcError:  # cancelled: by the timer, or by the sender
            service.count(rejected_requests=1)
            if late.is_set():
                _logger.warning(
                    "agentcap ingest: a gRPC message did not arrive within %g s",
                    self._limits.body_timeout,
                )
            return b""  # the call is cancelled: nothing is sent
        finally:
            timer.cancel()
        if request is None:
            service.count(rejected_requests=1)
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "no request message")
        try:
            outcome = service.process(decode_protobuf(request, self._limits.max_spans), principal)
        except TooManySpans as exc:
            # Without RetryInfo: OTLP senders do not retry it (it cannot succeed as it is).
            service.count(rejected_requests=1)
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DecodeError as exc:
            service.count(rejected_requests=1)
            self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"not an OTLP trace request: {exc}"
            )
        except RetryLater as exc:
            service.count(failed_requests=1)
            context.abort_with_status(_retry_status(str(exc), exc.retry_after))
            raise AssertionError("unreachable") from exc  # pragma: no cover
        response = ExportTraceServiceResponse()
        if outcome.rejected:
            response.partial_success.CopyFrom(
                ExportTracePartialSuccess(
                    rejected_spans=outcome.rejected, error_message=outcome.message()
                )
            )
        data: bytes = response.SerializeToString()
        return data


__all__ = ["METHOD", "SERVICE", "GrpcReceiver"]
