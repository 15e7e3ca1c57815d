"""The OTLP/HTTP receiver: a Starlette application, served by Hypercorn (see ``server``).

``POST /v1/traces`` with an ``ExportTraceServiceRequest`` as ``application/x-protobuf`` or
``application/json`` (OTLP/JSON), plain or ``Content-Encoding: gzip``. Answers, as the OTLP
specification defines them:

- 200 with an ``ExportTraceServiceResponse`` (protobuf or JSON, as the request): every span was
  accepted; ``partial_success`` holds the number of spans rejected and why, if any were;
- 400 a body that is not an OTLP trace request (or a gzip body cut short); 401 a missing or wrong
  bearer token; 408 a body that did not arrive in time; 413 a body over the limit, or a request
  of more than ``max_spans`` spans; 415 another content type or encoding: not retried by OTLP
  senders;
- 503 with ``Retry-After``: the event log is unavailable, or the server is saturated: retried.

Error bodies are a ``google.rpc.Status``. The body is read only once a processing slot is free,
counted and decompressed as it arrives; decoding and storing run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Final

import anyio.to_thread
from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from otel_agentcap.ingest.body import BodyError, BodyReader
from otel_agentcap.ingest.config import IngestLimits
from otel_agentcap.ingest.service import IngestService, Outcome, RetryLater
from otel_agentcap.ingest.wire import (
    DecodedRequest,
    DecodeError,
    RequestTooLarge,
    decode_json,
    decode_protobuf,
)
from otel_agentcap.tokens import Authenticator, Principal

_logger = logging.getLogger(__name__)

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"

_CODES: Final = {
    HTTPStatus.BAD_REQUEST: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.UNAUTHORIZED: code_pb2.UNAUTHENTICATED,
    HTTPStatus.NOT_FOUND: code_pb2.NOT_FOUND,
    HTTPStatus.METHOD_NOT_ALLOWED: code_pb2.UNIMPLEMENTED,
    HTTPStatus.REQUEST_TIMEOUT: code_pb2.DEADLINE_EXCEEDED,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: code_pb2.RESOURCE_EXHAUSTED,
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.INTERNAL_SERVER_ERROR: code_pb2.INTERNAL,
    HTTPStatus.SERVICE_UNAVAILABLE: code_pb2.UNAVAILABLE,
}


def error_response(
    status: HTTPStatus,
    message: str,
    *,
    json_body: bool = False,
    headers: dict[str, str] | None = None,
) -> Response:
    """A failure answer: ``status`` with a ``google.rpc.Status`` body."""
    body = status_pb2.Status(code=_CODES.get(status, code_pb2.UNKNOWN), message=message[:4096])
    if json_body:
        return Response(json_format.MessageToJson(body), status, headers, JSON)
    return Response(body.SerializeToString(), status, headers, PROTOBUF)


def success_response(outcome: Outcome, *, json_body: bool) -> Response:
    """200 with an ``ExportTraceServiceResponse``, ``partial_success`` set when spans were
    rejected (and left unset otherwise, as the specification requires)."""
    response = ExportTraceServiceResponse()
    if outcome.rejected:
        response.partial_success.CopyFrom(
            ExportTracePartialSuccess(
                rejected_spans=outcome.rejected, error_message=outcome.message()
            )
        )
    if json_body:
        return Response(json_format.MessageToJson(response), HTTPStatus.OK, media_type=JSON)
    return Response(response.SerializeToString(), HTTPStatus.OK, media_type=PROTOBUF)


def build_app(
    service: IngestService,
    authenticator: Authenticator,
    limits: IngestLimits,
    path: str,
) -> Starlette:
    """The Starlette application that receives traces on ``path``."""
    slots: asyncio.Semaphore | None = None

    def close_after(status: HTTPStatus, message: str, json_body: bool) -> Response:
        """An error answered before the body was read to its end: the connection closes."""
        service.count(rejected_requests=1)
        return error_response(status, message, json_body=json_body, headers={"Connection": "close"})

    def process(holder: list[bytearray], json_body: bool, principal: Principal) -> Outcome:
        # The body comes in a list it is taken out of: a worker thread keeps the arguments of
        # its last call until its next one, and must not keep the body alive that long.
        body = holder.pop()
        decoded: DecodedRequest = (
            decode_json(body, limits.max_spans, limits.max_json_memory)
            if json_body
            else decode_protobuf(body, limits.max_spans)
        )
        del body
        return service.process(decoded, principal)

    async def traces(request: Request) -> Response:
        nonlocal slots
        service.count(requests=1)
        headers = request.headers
        media = headers.get("content-type", PROTOBUF).split(";", 1)[0].strip().lower()
        json_body = media == JSON
        if media != PROTOBUF and not json_body:
            return close_after(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"unsupported Content-Type {media!r}; send {PROTOBUF} or {JSON}",
                False,
            )
        principal = authenticator.authenticate(headers.get("authorization"))
        if principal is None:
            service.count(unauthorized_requests=1)
            response = close_after(
                HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token", json_body
            )
            response.headers["WWW-Authenticate"] = 'Bearer realm="agentcap-ingest"'
            return response
        limit = limits.max_json_body_bytes if json_body else limits.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return close_after(HTTPStatus.BAD_REQUEST, "invalid Content-Length", json_body)
            if int(declared) > limit:
                return close_after(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request body over {limit} bytes",
                    json_body,
                )
        encoding = headers.get("content-encoding", "identity")
        try:
            BodyReader.check_encoding(encoding)
        except BodyError as exc:
            return close_after(exc.status, str(exc), json_body)
        if slots is None:
            slots = asyncio.Semaphore(limits.max_concurrent_requests)
        try:
            async with asyncio.timeout(limits.queue_timeout):
                await slots.acquire()
        except TimeoutError:
            service.count(failed_requests=1)
            _logger.warning("agentcap ingest: saturated, asking a sender to retry")
            return error_response(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the ingest is saturated; retry later",
                json_body=json_body,
                headers={"Retry-After": "1", "Connection": "close"},
            )
        try:
            # Created once a slot is free: it may allocate the declared length at once.
            reader = BodyReader(encoding, limit, int(declared) if declared is not None else None)
            try:
                async with asyncio.timeout(limits.body_timeout):
                    async for chunk in request.stream():
                        reader.feed(chunk)
                body = reader.finish()
                del reader
            except TimeoutError:
                return close_after(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"the body did not arrive within {limits.body_timeout:g} s",
                    json_body,
                )
            except BodyError as exc:
                return close_after(exc.status, str(exc), json_body)
            except ClientDisconnect:
                service.count(rejected_requests=1)
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody left to read it
            try:
                outcome = await anyio.to_thread.run_sync(process, [body], json_body, principal)
            except RequestTooLarge as exc:
                service.count(rejected_requests=1)
                return error_response(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(exc), json_body=json_body
                )
            except DecodeError as exc:
                service.count(rejected_requests=1)
                return error_response(
                    HTTPStatus.BAD_REQUEST,
                    f"not an OTLP trace request: {exc}",
                    json_body=json_body,
                )
            except RetryLater as exc:
                service.count(failed_requests=1)
                return error_response(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    str(exc),
                    json_body=json_body,
                    headers={"Retry-After": str(exc.retry_after)},
                )
            except Exception:
                _logger.exception("agentcap ingest: request failed unexpectedly")
                service.count(rejected_requests=1)
                return error_response(
                    HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", json_body=json_body
                )
            return success_response(outcome, json_body=json_body)
        finally:
            slots.release()

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        service.count(requests=1, rejected_requests=1)
        return error_response(
            HTTPStatus(status),
            f"POST OTLP traces to {path}" if status == 405 else f"no such path; use {path}",
            headers={"Allow": "POST"} if status == 405 else None,
        )

    return Starlette(
        routes=[Route(path, traces, methods=["POST"])],
        exception_handlers={404: not_found, 405: not_found},
    )
