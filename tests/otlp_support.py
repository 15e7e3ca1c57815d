"""Shared helpers of the OTLP ingest tests: captured spans, forged spans, raw HTTP requests."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import socket
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan

import otel_agentcap as ac
from otel_agentcap import attributes as attr
from otel_agentcap.model import event_id_for
from otel_agentcap.testing import capture_events


def program(run_id: str) -> None:
    """A small agent program: memory write and read, a spawn, a tool call, a failing tool."""
    memory = ac.Memory("notes")

    @ac.tool
    def double(x: int) -> int:
        return 2 * x

    @ac.tool
    def broken() -> None:
        raise RuntimeError("tool failed")

    with ac.run(run_id, owner="tests"), ac.agent("planner") as planner:
        memory["topics"] = ["clocks", "logs"]
        child = planner.spawn("worker", key="w")

        def work() -> None:
            double.invoke("call-1", len(memory["topics"]))
            with contextlib.suppress(RuntimeError):
                broken.invoke("call-2")

        child.run(work)


def captured(run_id: str) -> tuple[list[ReadableSpan], int]:
    """The spans of :func:`program` and the number of events they hold."""
    with capture_events() as events:
        program(run_id)
    assert events.events
    return list(events.spans), len(events.events)


def request_bytes(spans: list[ReadableSpan]) -> bytes:
    return encode_spans(spans).SerializeToString()


def forged(base: ReadableSpan, *, drop: tuple[str, ...] = (), **changes: Any) -> ReadableSpan:
    """``base`` with attributes changed (keyword names use ``__`` for dots) and some dropped;
    the closing-event record is dropped unless given."""
    attributes: dict[str, Any] = {
        k: v for k, v in (base.attributes or {}).items() if k not in drop and k != attr.OUTCOME
    }
    for key, value in changes.items():
        attributes[key.replace("__", ".")] = value
    return ReadableSpan(
        name=base.name,
        context=base.context,
        parent=base.parent,
        attributes=attributes,
        start_time=base.start_time,
        end_time=base.end_time,
        instrumentation_scope=base.instrumentation_scope,
    )


def event_span(
    base: ReadableSpan, run_id: str, agent_id: str, key: str, seq: int, **changes: Any
) -> ReadableSpan:
    """A span of a valid-looking event of ``agent_id`` (ids derived as the capture derives them),
    built from ``base``'s other attributes."""
    return forged(
        base,
        agentcap__run__id=run_id,
        agentcap__agent__id=agent_id,
        agentcap__event__id=event_id_for(run_id, agent_id, key),
        agentcap__event__idempotency_key=key,
        agentcap__event__seq=seq,
        **changes,
    )


def post(
    url: str,
    body: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    gzipped: bool = False,
    timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` (protobuf unless headers say otherwise); returns status, headers, body."""
    sent = {"Content-Type": "application/x-protobuf"}
    if gzipped:
        body = gzip.compress(body)
        sent["Content-Encoding"] = "gzip"
    sent.update(headers or {})
    host, _, rest = url.removeprefix("http://").partition("/")
    name, _, port = host.rpartition(":")
    conn = http.client.HTTPConnection(name, int(port), timeout=timeout)
    try:
        conn.request("POST", "/" + rest, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def partial_success(body: bytes) -> tuple[int, str]:
    """``(rejected_spans, error_message)`` of an ``ExportTraceServiceResponse``."""
    response = ExportTraceServiceResponse()
    response.ParseFromString(body)
    return response.partial_success.rejected_spans, response.partial_success.error_message


def raw_exchange(port: int, data: bytes, *, timeout: float = 10) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it or ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def count(dsn: str, query: str, *params: object) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
