"""The OTLP/gRPC receiver of the ingest: storage, partial success, tokens, limits, retry info."""

from __future__ import annotations

import gzip
import queue
import threading

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace.export import SpanExportResult
from otlp_support import captured, count, forged, free_port, request_bytes

from otel_agentcap.ingest import Authenticator, IngestLimits, OtlpIngestServer
from otel_agentcap.ingest.grpc_server import METHOD

pytestmark = pytest.mark.storage

EVENTS = "SELECT count(*) FROM agentcap.events WHERE run_id = %s"


def _call(
    endpoint: str,
    body: bytes,
    *,
    metadata: tuple[tuple[str, str], ...] = (),
    compression: grpc.Compression | None = None,
) -> bytes:
    with grpc.insecure_channel(
        endpoint, options=[("grpc.max_send_message_length", 256 * 1024 * 1024)]
    ) as channel:
        export = channel.unary_unary(METHOD)
        return export(body, metadata=metadata, timeout=30, compression=compression)


def test_spans_exported_over_grpc_are_stored(pg_dsn):
    """The SDK's OTLP/gRPC exporter (gzip) stores every event, once even when sent twice."""
    spans, expected = captured("run-grpc")
    with OtlpIngestServer(pg_dsn, port=0, grpc_port=0) as server:
        assert server.grpc_endpoint is not None
        exporter = OTLPSpanExporter(
            endpoint=server.grpc_endpoint, insecure=True, compression=grpc.Compression.Gzip
        )
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        stats = server.stats()
    assert count(pg_dsn, EVENTS, "run-grpc") == expected
    assert (stats.events_inserted, stats.duplicates) == (expected, expected)


def test_a_bad_span_over_grpc_is_rejected_alone(pg_dsn):
    """A span with a sequence that is not a number is reported in partial_success; the others
    are stored."""
    spans, expected = captured("run-grpc-bad")
    bad = forged(next(s for s in spans if s.name == "memory_write"), agentcap__event__seq="x")
    with OtlpIngestServer(pg_dsn, port=0, grpc_port=0) as server:
        answer = ExportTraceServiceResponse.FromString(
            _call(server.grpc_endpoint or "", request_bytes([*spans, bad]))
        )
    assert answer.partial_success.rejected_spans == 1
    assert "not an integer" in answer.partial_success.error_message
    assert count(pg_dsn, EVENTS, "run-grpc-bad") == expected


def test_grpc_checks_the_bearer_token(pg_dsn):
    """Without the token the call fails UNAUTHENTICATED; with it, spans are stored."""
    spans, expected = captured("run-grpc-token")
    authenticator = Authenticator([("grpc-token-0123456789", None)])
    with OtlpIngestServer(pg_dsn, port=0, grpc_port=0, authenticator=authenticator) as server:
        endpoint = server.grpc_endpoint or ""
        with pytest.raises(grpc.RpcError) as info:
            _call(endpoint, request_bytes(spans))
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        _call(
            endpoint,
            request_bytes(spans),
            metadata=(("authorization", "Bearer grpc-token-0123456789"),),
        )
    assert count(pg_dsn, EVENTS, "run-grpc-token") == expected


def test_grpc_refuses_what_is_too_large_or_not_a_request(pg_dsn):
    """A message over the limit (also one that is only over it once decompressed) is
    RESOURCE_EXHAUSTED; bytes that are not a request are INVALID_ARGUMENT; nothing is stored."""
    limits = IngestLimits(max_body_bytes=1024 * 1024)
    with OtlpIngestServer(pg_dsn, port=0, grpc_port=0, limits=limits) as server:
        endpoint = server.grpc_endpoint or ""
        for body, compression in (
            (b"\0" * (2 * 1024 * 1024), None),
            (b"\0" * (64 * 1024 * 1024), grpc.Compression.Gzip),
        ):
            with pytest.raises(grpc.RpcError) as info:
                _call(endpoint, body, compression=compression)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            _call(endpoint, b"\x0a\x05abc")  # a field that runs past the end
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert count(pg_dsn, "SELECT count(*) FROM agentcap.events") == 0
    assert len(gzip.compress(b"\0" * 1024)) < 1024  # the bomb above is small on the wire


def test_grpc_refuses_a_request_of_more_spans_than_the_limit_for_good(pg_dsn):
    """A request of more spans than ``max_spans`` fails RESOURCE_EXHAUSTED without a RetryInfo
    (so OTLP senders do not retry it) and stores nothing."""
    spans, _ = captured("run-grpc-max-spans")
    limits = IngestLimits(max_spans=len(spans) - 1)
    with (
        OtlpIngestServer(pg_dsn, port=0, grpc_port=0, limits=limits) as server,
        pytest.raises(grpc.RpcError) as info,
    ):
        _call(server.grpc_endpoint or "", request_bytes(spans))
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"more than {len(spans) - 1} spans" in (info.value.details() or "")
    trailing = dict(info.value.trailing_metadata() or ())
    assert "grpc-status-details-bin" not in trailing
    assert count(pg_dsn, EVENTS, "run-grpc-max-spans") == 0


def test_grpc_asks_to_retry_with_retry_info_when_the_database_is_down():
    """With PostgreSQL down the call fails UNAVAILABLE with a google.rpc.RetryInfo detail."""
    spans, _ = captured("run-grpc-down")
    dsn = f"postgresql://agentcap@127.0.0.1:{free_port()}/agentcap?connect_timeout=1"
    with (
        OtlpIngestServer(dsn, port=0, grpc_port=0, connect_timeout=0.5) as server,
        pytest.raises(grpc.RpcError) as info,
    ):
        _call(server.grpc_endpoint or "", request_bytes(spans))
    error = info.value
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    details = dict(error.trailing_metadata() or ())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(details)
    retry = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry) and retry.retry_delay.seconds >= 1


def test_grpc_asks_to_retry_with_retry_info_when_a_lock_is_held_on_the_log(pg_dsn):
    """While another session holds a lock on the events table, the call fails UNAVAILABLE with
    a RetryInfo after limits.lock_timeout (not left hanging); nothing is stored."""
    spans, _ = captured("run-grpc-locked")
    limits = IngestLimits(lock_timeout=0.2)
    with (
        OtlpIngestServer(pg_dsn, port=0, grpc_port=0, limits=limits) as server,
        psycopg.connect(pg_dsn) as holder,
    ):
        holder.execute("LOCK TABLE agentcap.events IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(grpc.RpcError) as info:
            _call(server.grpc_endpoint or "", request_bytes(spans))
    error = info.value
    assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()
    assert "lock" in (error.details() or "")
    details = dict(error.trailing_metadata() or ())["grpc-status-details-bin"]
    retry = error_details_pb2.RetryInfo()
    assert status_pb2.Status.FromString(details).details[0].Unpack(retry)
    assert retry.retry_delay.seconds == limits.retry_after
    assert count(pg_dsn, EVENTS, "run-grpc-locked") == 0


def test_a_saturated_grpc_receiver_asks_to_retry_with_retry_info(pg_dsn):
    """With every processing slot taken, calls that cannot be served within the queue timeout
    fail UNAVAILABLE with a RetryInfo (a collector retries them), never RESOURCE_EXHAUSTED
    without one, which a collector drops as permanent; the call holding the slot then succeeds."""
    limits = IngestLimits(max_concurrent_requests=1, queue_timeout=0.2)
    release = threading.Event()
    with OtlpIngestServer(pg_dsn, port=0, grpc_port=0, limits=limits) as server:
        process = server.service.process

        def held(*args, **kwargs):
            release.wait()
            return process(*args, **kwargs)

        server.service.process = held  # type: ignore[method-assign]
        finished: queue.Queue[grpc.Future] = queue.Queue()
        with grpc.insecure_channel(server.grpc_endpoint or "") as channel:
            export = channel.unary_unary(METHOD)
            # More calls than threads waiting for a slot (8), fewer than the streams a connection
            # may open at once (16).
            calls = [export.future(b"", timeout=120) for _ in range(12)]
            for call in calls:
                call.add_done_callback(finished.put)
            try:
                for _ in range(len(calls) - 1):  # all but the call in the slot
                    error = finished.get(timeout=120).exception()
                    assert isinstance(error, grpc.Call)
                    assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()
                    details = dict(error.trailing_metadata() or ())["grpc-status-details-bin"]
                    retry = error_details_pb2.RetryInfo()
                    assert status_pb2.Status.FromString(details).details[0].Unpack(retry)
            finally:
                release.set()
            assert finished.get(timeout=120).exception() is None
    assert server.stats().failed_requests == len(calls) - 1


def test_a_grpc_message_that_does_not_arrive_in_time_frees_its_slot(pg_dsn):
    """A call whose message does not arrive within the body timeout is ended by the server, and
    the slot it held serves the next call: a slow sender cannot hold the gRPC receiver."""
    spans, expected = captured("run-grpc-slow")
    limits = IngestLimits(max_concurrent_requests=1, body_timeout=0.5, queue_timeout=60)
    send = threading.Event()
    held = threading.Event()

    def never_sent():
        send.wait()
        yield request_bytes(spans)

    class Slots:
        def __init__(self, slots):
            self.slots = slots

        def acquire(self, timeout):
            taken = self.slots.acquire(timeout=timeout)
            held.set()
            return taken

        def release(self):
            self.slots.release()

    with OtlpIngestServer(pg_dsn, port=0, grpc_port=0, limits=limits) as server:
        assert server._grpc is not None
        server._grpc._slots = Slots(server._grpc._slots)
        endpoint = server.grpc_endpoint or ""
        with grpc.insecure_channel(endpoint) as channel:
            slow = channel.stream_unary(METHOD).future(never_sent(), timeout=120)
            try:
                assert held.wait(60)
                _call(endpoint, request_bytes(spans))  # fails after 30 s if the slot stays held
            finally:
                send.set()
            error = slow.exception()
    assert isinstance(error, grpc.Call) and error.code() is grpc.StatusCode.CANCELLED
    assert count(pg_dsn, EVENTS, "run-grpc-slow") == expected
