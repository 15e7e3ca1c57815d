"""The OTLP/HTTP ingest as a trust boundary: per-span rejection, forged spans, HTTP edge cases,
limits, timeouts, tokens, graceful shutdown."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from otlp_support import (
    captured,
    count,
    event_span,
    forged,
    partial_success,
    post,
    raw_exchange,
    request_bytes,
)

from otel_agentcap import attributes as attr
from otel_agentcap.exporters.postgres.sequences import reserve_sequence_block
from otel_agentcap.ingest import Authenticator, IngestLimits, OtlpIngestServer, decode_protobuf
from otel_agentcap.ingest.wire import json_memory_bound
from otel_agentcap.model import event_id_for

pytestmark = pytest.mark.storage

EVENTS = "SELECT count(*) FROM agentcap.events WHERE run_id = %s"


@pytest.fixture()
def server(pg_dsn: str) -> Iterator[OtlpIngestServer]:
    with OtlpIngestServer(pg_dsn, port=0) as srv:
        yield srv


def _memory_write(spans):
    return next(s for s in spans if s.name == "memory_write")


def test_one_unreadable_span_is_rejected_alone(pg_dsn, server):
    """A span whose sequence is not a number is rejected alone with a reason in partial_success;
    every good span of the same request is stored, and the answer is 200 (not 503 for ever)."""
    spans, expected = captured("run-bad-seq")
    bad = forged(_memory_write(spans), agentcap__event__seq="not a number")
    status, _, body = post(server.endpoint, request_bytes([*spans, bad]))
    assert status == 200
    rejected, message = partial_success(body)
    assert rejected == 1 and "agentcap.event.seq is not an integer" in message
    assert count(pg_dsn, EVENTS, "run-bad-seq") == expected
    assert server.stats().spans_rejected == 1


def test_a_non_uuid_event_id_among_good_spans_is_rejected_alone(pg_dsn, server):
    """One span with an event id that is not a UUID among 50 valid ones: the 50 are stored and
    the answer says one span was rejected."""
    spans, expected = captured("run-50")
    base = _memory_write(spans)
    good = [
        event_span(base, "run-50", "planner", f"extra-{i}", 1000 + i)
        for i in range(50 - len(spans))
    ]
    bad = forged(base, agentcap__event__id="not-a-uuid")
    status, _, body = post(server.endpoint, request_bytes([*spans, *good, bad]))
    assert status == 200
    assert partial_success(body)[0] == 1
    assert count(pg_dsn, EVENTS, "run-50") == expected + len(good)


def test_forged_event_under_another_runs_event_id_is_rejected(pg_dsn, server):
    """A forged tool_result sent before the real one, under the real event's id but from another
    run, is rejected; the real event is then stored and nothing goes to conflicts."""
    spans, expected = captured("run-victim")
    tool = next(s for s in spans if s.name == "execute_tool double")
    real_id = str(tool.attributes[attr.EVENT_ID])
    forgery = forged(
        tool,
        agentcap__run__id="run-attacker",
        agentcap__event__payload='{"forged": true}',
        agentcap__event__id=real_id,
    )
    status, _, body = post(server.endpoint, request_bytes([forgery]))
    assert status == 200 and partial_success(body)[0] == 1
    assert post(server.endpoint, request_bytes(spans))[0] == 200
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT run_id, payload FROM agentcap.events WHERE event_id = %s", (real_id,)
        ).fetchone()
    assert row is not None and row[0] == "run-victim" and "forged" not in row[1]
    assert count(pg_dsn, "SELECT count(*) FROM agentcap.conflicts") == 0
    assert count(pg_dsn, EVENTS, "run-victim") == expected


def _stored_state(dsn: str, run_id: str) -> tuple[object, ...]:
    with psycopg.connect(dsn) as conn:
        agents = conn.execute(
            "SELECT agent_id, name, parent_agent_id, spawned_at_event_id::text FROM agentcap.agents"
            " WHERE run_id = %s ORDER BY agent_id",
            (run_id,),
        ).fetchall()
        run = conn.execute(
            "SELECT started_at, attributes FROM agentcap.runs WHERE run_id = %s", (run_id,)
        ).fetchall()
        events = conn.execute(
            "SELECT event_id::text, logical_seq, event_type, payload FROM agentcap.events"
            " WHERE run_id = %s ORDER BY event_id",
            (run_id,),
        ).fetchall()
    return agents, run, events


def test_forged_spans_change_nothing_stored(pg_dsn, server):
    """Forged spans for a stored run cannot give a root agent a parent, rename an agent, move
    the run's start, add run attributes or change a stored event: the stored rows stay as they
    were and each difference is kept in a conflicts table."""
    spans, _ = captured("run-stored")
    assert post(server.endpoint, request_bytes(spans))[0] == 200
    before = _stored_state(pg_dsn, "run-stored")
    start = next(s for s in spans if s.name == "invoke_agent planner")
    write = _memory_write(spans)
    old = int(datetime(2001, 1, 1, tzinfo=UTC).timestamp() * 1e9)
    forgeries = [
        # A root agent given a parent, with a self-consistent spawn link.
        event_span(
            start,
            "run-stored",
            "planner",
            "forged-start",
            5000,
            agentcap__event__type="agent_start",
            agentcap__parent__agent_id="intruder",
            agentcap__spawned_at_event_id=event_id_for("run-stored", "intruder", "spawn:planner"),
            gen_ai__agent__name="renamed",
            agentcap__run__attributes='{"owner": "mallory", "extra": 1}',
        ),
        # A stored event sent again with other content (same id).
        forged(write, agentcap__event__payload='{"forged": true}'),
    ]
    early = forged(forgeries[0], agentcap__event__seq=5001)
    early = type(early)(
        name=early.name,
        context=early.context,
        attributes={
            **(early.attributes or {}),
            attr.EVENT_ID: event_id_for("run-stored", "planner", "forged-early"),
            attr.EVENT_IDEMPOTENCY_KEY: "forged-early",
        },
        start_time=old,
        end_time=old,
    )
    status, _, body = post(server.endpoint, request_bytes([*forgeries, early]))
    assert status == 200, body
    agents, run, events = _stored_state(pg_dsn, "run-stored")
    assert (agents, run) == before[:2]
    stored = {e[0]: e for e in events}
    assert all(stored[e[0]] == e for e in before[2])  # no stored event changed
    with psycopg.connect(pg_dsn) as conn:
        reasons = sorted(r[0] for r in conn.execute("SELECT reason FROM agentcap.record_conflicts"))
        conflicts = [r[0] for r in conn.execute("SELECT reason FROM agentcap.conflicts")]
    assert reasons == ["agent_lineage", "agent_name", "run_attributes"]
    assert conflicts == ["event_id_content"]


def test_forged_sequence_far_above_the_range_is_rejected(pg_dsn, server):
    """A sequence of 2**63 - 1 is rejected; the agent's later sequence reservations still work
    (they failed with "bigint out of range")."""
    spans, _ = captured("run-far")
    far = event_span(_memory_write(spans), "run-far", "planner", "far", 2**63 - 1)
    status, _, body = post(server.endpoint, request_bytes([*spans, far]))
    assert status == 200
    rejected, message = partial_success(body)
    assert rejected == 1 and "sequence" in message
    with psycopg.connect(pg_dsn) as conn:
        start = reserve_sequence_block(conn, "run-far", "planner", at_least=1, size=1024)
    assert start < 2**62


def test_span_with_only_an_event_id_is_rejected(pg_dsn, server):
    """A span that carries an event id and nothing else is rejected: no agents row ('', '') and
    no runs row '' appear."""
    spans, _ = captured("run-only-id")
    bare = forged(
        _memory_write(spans),
        drop=tuple(k for k in (_memory_write(spans).attributes or {}) if k != attr.EVENT_ID),
    )
    status, _, body = post(server.endpoint, request_bytes([bare]))
    assert status == 200 and partial_success(body)[0] == 1
    assert count(pg_dsn, "SELECT count(*) FROM agentcap.agents WHERE agent_id = ''") == 0
    assert count(pg_dsn, "SELECT count(*) FROM agentcap.runs WHERE run_id = ''") == 0


def test_spans_without_agentcap_attributes_are_accepted_and_ignored(pg_dsn, server):
    """Spans of other instrumentations are accepted (200, nothing rejected), not stored, and
    counted as ignored."""
    spans, expected = captured("run-mixed")
    other = forged(_memory_write(spans), drop=tuple(_memory_write(spans).attributes or {}))
    status, _, body = post(server.endpoint, request_bytes([*spans, other, other]))
    assert status == 200 and partial_success(body) == (0, "")
    assert count(pg_dsn, EVENTS, "run-mixed") == expected
    assert server.stats().spans_ignored == 2


def test_chunked_body_with_a_bad_size_line_gets_an_answer(server):
    """A chunked body whose size line is not hex is answered 400; the connection is not just
    dropped."""
    head = (
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    answer = raw_exchange(server.port, head + b"zz\r\nhello\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400")


def test_chunked_and_compressed_bodies_in_many_pieces_are_stored(pg_dsn, server):
    """A gzip body sent in 1-byte chunks, with a chunk extension and a trailer, is stored."""
    spans, expected = captured("run-chunked")
    body = gzip.compress(request_bytes(spans))
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (1, body[i : i + 1]) for i in range(len(body)))
    head = (
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    answer = raw_exchange(server.port, head + chunks + b"0\r\nX-Trailer: 1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert count(pg_dsn, EVENTS, "run-chunked") == expected


def _flush_point(data: bytes) -> bytes:
    """``data`` compressed as gzip and cut at a flush point (no final block, no trailer)."""
    compressor = zlib.compressobj(wbits=31)
    return compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)


@pytest.mark.parametrize(
    "damage",
    ["no trailer", "flush point", "bad crc", "bad length", "trailing garbage"],
)
def test_a_damaged_gzip_body_stores_nothing(pg_dsn, server, damage):
    """A gzip body cut before its trailer or at a flush point, with a wrong CRC or length, or
    with garbage after it, is answered 400 and stores nothing."""
    spans, _ = captured("run-gzip")
    data = request_bytes(spans)
    whole = gzip.compress(data)
    body = {
        "no trailer": whole[:-8],
        "flush point": _flush_point(data),
        "bad crc": whole[:-8] + bytes([whole[-8] ^ 0xFF]) + whole[-7:],
        "bad length": whole[:-4] + bytes([whole[-4] ^ 0x01]) + whole[-3:],
        "trailing garbage": whole + b"garbage!",
    }[damage]
    status, _, _ = post(server.endpoint, body, headers={"Content-Encoding": "gzip"})
    assert status == 400
    assert count(pg_dsn, "SELECT count(*) FROM agentcap.events") == 0


def test_gzip_members_back_to_back_are_one_body(pg_dsn, server):
    """A body of two gzip members (RFC 1952 allows it) is read whole."""
    spans, expected = captured("run-members")
    data = request_bytes(spans)
    body = gzip.compress(data[:100]) + gzip.compress(data[100:])
    status, _, _ = post(server.endpoint, body, headers={"Content-Encoding": "gzip"})
    assert status == 200
    assert count(pg_dsn, EVENTS, "run-members") == expected


def test_bodies_over_the_limit_are_413(pg_dsn):
    """A declared length over the limit, a chunked body over it and a gzip bomb are 413; the bomb
    is not inflated past the limit."""
    limits = IngestLimits(max_body_bytes=1024 * 1024)
    with OtlpIngestServer(pg_dsn, port=0, limits=limits) as server:
        head = (
            "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {2 * 1024 * 1024}\r\n\r\n"
        ).encode()
        assert raw_exchange(server.port, head).startswith(b"HTTP/1.1 413")
        bomb = gzip.compress(b"\0" * (64 * 1024 * 1024))
        status, _, _ = post(server.endpoint, bomb, headers={"Content-Encoding": "gzip"})
        assert status == 413
        head = head.replace(
            f"Content-Length: {2 * 1024 * 1024}".encode(), b"Transfer-Encoding: chunked"
        )
        chunk = b"%x\r\n%s\r\n" % (65536, b"\0" * 65536)
        answer = raw_exchange(server.port, head + chunk * 17 + b"0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 413")


def test_a_request_of_more_spans_than_the_limit_is_413_and_stores_nothing(pg_dsn):
    """A request of more spans than ``max_spans`` (protobuf or OTLP/JSON) is refused whole with
    413 and a google.rpc.Status saying so, before any span is stored; one of exactly the limit
    is stored."""
    from google.rpc import status_pb2

    spans, expected = captured("run-max-spans")
    data = request_bytes(spans)
    as_json = _json_request(spans)
    limits = IngestLimits(max_spans=len(spans) - 1)
    with OtlpIngestServer(pg_dsn, port=0, limits=limits) as server:
        status, _, body = post(server.endpoint, data)
        assert status == 413
        assert f"more than {len(spans) - 1} spans" in status_pb2.Status.FromString(body).message
        status, _, body = post(
            server.endpoint, as_json, headers={"Content-Type": "application/json"}
        )
        assert status == 413 and b"more than" in body
        assert server.stats().rejected_requests == 2
    assert count(pg_dsn, EVENTS, "run-max-spans") == 0
    with OtlpIngestServer(pg_dsn, port=0, limits=IngestLimits(max_spans=len(spans))) as server:
        assert post(server.endpoint, data)[0] == 200
    assert count(pg_dsn, EVENTS, "run-max-spans") == expected


def test_unsupported_requests_get_status_bodies(server):
    """Another content type or encoding is 415, another path 404, GET 405, each with a
    google.rpc.Status body."""
    from google.rpc import status_pb2

    assert post(server.endpoint, b"", headers={"Content-Type": "text/plain"})[0] == 415
    assert post(server.endpoint, b"x", headers={"Content-Encoding": "br"})[0] == 415
    status, _, body = post(server.endpoint.replace("/v1/traces", "/v1/logs"), b"")
    assert status == 404 and status_pb2.Status.FromString(body).message
    answer = raw_exchange(server.port, b"GET /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n", timeout=2)
    assert answer.startswith(b"HTTP/1.1 405")


def _json_request(spans) -> bytes:
    """An OTLP/JSON request: protobuf's JSON mapping with hex trace and span ids and integer
    enums, as the OTLP specification defines it."""
    data = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for rs in data.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for obj in (span, *span.get("links", [])):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in obj:
                            obj[key] = base64.b64decode(obj[key]).hex().upper()
    return json.dumps(data).encode()


def test_otlp_json_is_stored_like_protobuf(pg_dsn, server):
    """The same spans as OTLP/JSON (hex ids, camelCase) store the same events, and a rejected
    span is reported in a JSON partialSuccess."""
    spans, expected = captured("run-json")
    bad = forged(_memory_write(spans), agentcap__event__seq="x")
    status, headers, body = post(
        server.endpoint,
        _json_request([*spans, bad]),
        headers={"Content-Type": "application/json"},
    )
    assert status == 200 and headers["content-type"].startswith("application/json")
    answer = json.loads(body)
    assert answer["partialSuccess"]["rejectedSpans"] in ("1", 1)
    assert count(pg_dsn, EVENTS, "run-json") == expected


def _replaced(span: ReadableSpan, **values: object) -> ReadableSpan:
    """``span`` with the attributes ``values`` (names with dots) set, every other one kept."""
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        attributes={**(span.attributes or {}), **values},
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def test_values_that_are_not_json_objects_are_kept_in_markers_counted_and_logged(
    pg_dsn, server, caplog
):
    """Declared run attributes that are not a JSON object (a list) and an event payload that is
    not JSON are stored as ``$agentcap.unparsed`` markers holding their text, as import stores
    them, and counted and logged: never dropped in silence."""
    spans, expected = captured("run-marked")
    declared = '[1, "two"]'
    cut = '{"op": "set", "ke'
    sent = [
        _replaced(
            s,
            **(
                {attr.RUN_ATTRIBUTES: declared}
                if attr.RUN_ATTRIBUTES in (s.attributes or {})
                else {}
            ),
            **({attr.EVENT_PAYLOAD: cut} if s.name == "memory_write" else {}),
        )
        for s in spans
    ]
    assert sum(attr.RUN_ATTRIBUTES in (s.attributes or {}) for s in sent) >= 2
    with caplog.at_level(logging.WARNING):
        status, _, body = post(server.endpoint, request_bytes(sent))
    assert status == 200 and partial_success(body) == (0, "")
    assert count(pg_dsn, EVENTS, "run-marked") == expected
    with psycopg.connect(pg_dsn) as conn:
        (attributes,) = conn.execute(
            "SELECT attributes FROM agentcap.runs WHERE run_id = 'run-marked'"
        ).fetchone()
        payloads = [
            row[0]
            for row in conn.execute(
                "SELECT payload FROM agentcap.events WHERE run_id = 'run-marked'"
                " AND event_type = 'memory_write'"
            )
        ]
    assert attributes == {"$agentcap.unparsed": declared}
    assert {"$agentcap.unparsed": cut} in payloads
    stats = server.stats()
    assert (stats.unparsed_attributes, stats.unparsed_payloads) == (1, 1)
    assert "'run-marked' are not a JSON object" in caplog.text
    assert "1 payload(s) are not JSON" in caplog.text


def test_idle_and_slow_connections_are_closed(pg_dsn):
    """300 connections that send nothing, and one that sends its request head a byte at a time,
    are closed by the server after the idle timeout."""
    limits = IngestLimits(idle_timeout=1, read_timeout=1)
    with OtlpIngestServer(pg_dsn, port=0, limits=limits) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(300)]
        slow = socket.create_connection(("127.0.0.1", server.port))
        started = time.monotonic()
        try:
            head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 30
            closed_slow = False
            for byte in head:  # 6 s of trickling, far past the idle timeout
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed_slow = True
                    break
                time.sleep(0.1)
            if not closed_slow:
                slow.settimeout(3)
                try:
                    closed_slow = slow.recv(100) == b""
                except ConnectionResetError:
                    closed_slow = True
                except TimeoutError:
                    pass
            for sock in idle:
                sock.settimeout(max(0.1, 6 - (time.monotonic() - started)))
            closed = 0
            for sock in idle:
                try:
                    if sock.recv(10) == b"":
                        closed += 1
                except ConnectionResetError:
                    closed += 1
                except TimeoutError:
                    pass
        finally:
            for sock in [*idle, slow]:
                sock.close()
    assert closed == 300
    assert closed_slow


def test_a_slow_body_gets_408(pg_dsn):
    """A body that does not arrive within the body timeout is answered 408."""
    limits = IngestLimits(body_timeout=1, read_timeout=5, idle_timeout=5)
    with OtlpIngestServer(pg_dsn, port=0, limits=limits) as server:
        head = (
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 100\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head + b"\0" * 10)
            answer = sock.recv(1000)
    assert answer.startswith(b"HTTP/1.1 408")


def _hold_slot(port: int, length: int = 1000) -> socket.socket:
    """A request whose head and part of its body are sent: it holds a processing slot."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        (
            "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {length}\r\n\r\n"
        ).encode()
        + b"\n"
    )
    return sock


def test_a_saturated_server_answers_503_with_retry_after(pg_dsn):
    """With every processing slot taken, a request waits up to the queue timeout, then gets 503
    with Retry-After (a sender retries it)."""
    limits = IngestLimits(max_concurrent_requests=1, queue_timeout=0.5)
    with OtlpIngestServer(pg_dsn, port=0, limits=limits) as server:
        holder = _hold_slot(server.port)
        try:
            time.sleep(0.3)
            status, headers, _ = post(server.endpoint, b"")
        finally:
            holder.close()
        assert status == 503 and headers["retry-after"] == "1"
        assert server.stats().failed_requests == 1


def test_close_lets_requests_in_progress_finish(pg_dsn):
    """A request whose body is still arriving when the server is asked to close is read, stored
    and answered 200; the server stops afterwards."""
    spans, expected = captured("run-graceful")
    body = request_bytes(spans)
    server = OtlpIngestServer(pg_dsn, port=0).start()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(
            (
                "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body[:10]
        )
        time.sleep(0.3)
        closer = threading.Thread(target=server.close)
        closer.start()
        time.sleep(0.5)
        assert closer.is_alive()  # waiting for the request in progress
        sock.sendall(body[10:])
        answer = sock.recv(1000)
        closer.join(30)
    finally:
        sock.close()
        server.close()
    assert answer.startswith(b"HTTP/1.1 200")
    assert count(pg_dsn, EVENTS, "run-graceful") == expected
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_bearer_tokens_and_the_runs_they_may_write(pg_dsn):
    """Without the token, or with a wrong one, the answer is 401 and nothing is stored; a token
    bound to a run prefix stores spans of its runs and has the others rejected."""
    authenticator = Authenticator(
        [("admin-token-0123456789", None), ("team-a-token-012345678", "team-a/*")]
    )
    spans_a, expected = captured("team-a/run")
    spans_b, _ = captured("team-b/run")
    body = request_bytes([*spans_a, *spans_b])
    with OtlpIngestServer(pg_dsn, port=0, authenticator=authenticator) as server:
        missing = post(server.endpoint, body)
        wrong = post(server.endpoint, body, headers={"Authorization": "Bearer nope-nope-nope-nope"})
        scoped = post(
            server.endpoint, body, headers={"Authorization": "Bearer team-a-token-012345678"}
        )
        stats = server.stats()
    assert missing[0] == wrong[0] == 401
    assert missing[1]["www-authenticate"].startswith("Bearer")
    assert scoped[0] == 200
    rejected, message = partial_success(scoped[2])
    assert rejected == len(spans_b) and "may not write run 'team-b/run'" in message
    assert count(pg_dsn, EVENTS, "team-a/run") == expected
    assert count(pg_dsn, EVENTS, "team-b/run") == 0
    assert stats.unauthorized_requests == 2


def test_ingest_answers_503_with_retry_after_when_the_database_is_down():
    """A request that cannot be stored because PostgreSQL is down answers 503 with Retry-After."""
    from otlp_support import free_port

    spans, _ = captured("run-down")
    dsn = f"postgresql://agentcap@127.0.0.1:{free_port()}/agentcap?connect_timeout=1"
    with OtlpIngestServer(dsn, port=0, connect_timeout=0.5) as server:
        status, headers, _ = post(server.endpoint, request_bytes(spans))
    assert status == 503 and int(headers["retry-after"]) >= 1


@pytest.mark.parametrize("table", ["agentcap.events", "agentcap.schema_version"])
def test_a_lock_held_on_the_log_is_answered_503_after_the_lock_timeout(pg_dsn, table):
    """While another session holds a lock on the log (a LOCK TABLE in psql, a migration), a
    request waits at most limits.lock_timeout, then is answered 503 with Retry-After (not left
    hanging); sent again once the lock is released, it is stored."""
    spans, expected = captured("run-locked")
    body = request_bytes(spans)
    limits = IngestLimits(lock_timeout=0.2)
    with OtlpIngestServer(pg_dsn, port=0, limits=limits) as server:
        with psycopg.connect(pg_dsn) as holder:
            holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            status, headers, _ = post(server.endpoint, body)
            assert count(pg_dsn, "SELECT count(*) FROM pg_locks WHERE NOT granted") == 0
        assert status == 503 and headers["retry-after"] == str(limits.retry_after)
        assert server.stats().failed_requests == 1
        assert post(server.endpoint, body)[0] == 200
    assert count(pg_dsn, EVENTS, "run-locked") == expected


def test_a_span_with_a_malformed_parent_span_id_is_rejected_alone(pg_dsn, server):
    """A span whose parent span id is 100 bytes is rejected alone, counted and named in
    partial_success (it was stored as a root span, its parent dropped without a word); the other
    spans of the request are stored."""
    spans, expected = captured("run-bad-parent")
    request = encode_spans(spans)
    [child] = [
        s
        for r in request.resource_spans
        for scope in r.scope_spans
        for s in scope.spans
        if s.name == "memory_write"
    ]
    child.parent_span_id = b"\1" * 100
    status, _, body = post(server.endpoint, request.SerializeToString())
    assert status == 200
    rejected, message = partial_success(body)
    assert rejected == 1 and "parent span id is 100 bytes, not 8" in message
    assert server.stats().spans_rejected == 1
    stored = count(pg_dsn, EVENTS, "run-bad-parent")
    assert 0 < stored < expected
    assert count(pg_dsn, "SELECT count(*) FROM agentcap.spans WHERE name = 'memory_write'") == 0


def test_decode_protobuf_is_checked_whole_before_any_span(pg_dsn, server):
    """A request whose framing breaks after many good spans stores none of them."""
    spans, _ = captured("run-cut")
    data = request_bytes(spans)
    cut = data[:-3]
    with pytest.raises(ValueError):
        decode_protobuf(cut)
    status, _, _ = post(server.endpoint, cut)
    assert status == 400
    assert count(pg_dsn, "SELECT count(*) FROM agentcap.events") == 0


def _status_mib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    raise AssertionError(field)


def _small_spans_request(size: int) -> bytes:
    """A protobuf request of about ``size`` bytes of ~300-byte spans of another instrumentation."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1 import trace_pb2

    span = trace_pb2.Span(
        trace_id=b"\1" * 16,
        span_id=b"\2" * 8,
        name="GET /api/items",
        start_time_unix_nano=1,
        attributes=[
            KeyValue(key=f"http.attribute.{i}", value=AnyValue(string_value="v" * 20))
            for i in range(8)
        ],
    ).SerializeToString()
    framed = b"\x12" + _varint(len(span)) + span
    spans = framed * (size // len(framed))
    scope = b"\x12" + _varint(len(spans)) + spans
    return b"\x0a" + _varint(len(scope)) + scope


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@pytest.mark.multiprocess
def test_concurrent_large_requests_stay_within_the_memory_bound(pg_dsn):
    """Eight large requests at once (protobuf requests of ~100,000 small spans, gzip bombs, and
    OTLP/JSON of nested objects, which decode to 36 times their size: under the JSON limit but
    over what may be decoded, and just under that) against `otel-agentcap ingest`: its peak
    memory grows by less than its configured bound (requests processed at once x body limit,
    twice over for the buffers), whatever the number and shape of requests, and every request
    gets an answer."""
    import concurrent.futures
    import subprocess
    import sys

    from otlp_support import free_port

    mib = 32
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "otel_agentcap.cli",
            "ingest",
            "--dsn",
            pg_dsn,
            "--port",
            str(port),
            "--max-body-mib",
            str(mib),
            "--max-concurrent",
            "2",
            "--max-spans",
            "200000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the ingest did not start"
                time.sleep(0.1)
        plain = _small_spans_request(mib * 1024 * 1024 - 4096)
        bomb = gzip.compress(b"\0" * (4 * mib * 1024 * 1024))
        nested = b'{"":{"":{"":{}}}}'
        dense = _json_filler(nested, 15 * 1024 * 1024)  # under the 16 MiB JSON limit
        fits = _json_filler(nested, 2 * mib * 1024 * 1024 // 80)
        assert json_memory_bound(fits) <= 2 * mib * 1024 * 1024 < json_memory_bound(dense)
        json_headers = {"Content-Type": "application/json"}
        before = _status_mib(proc.pid, "VmHWM")
        url = f"http://127.0.0.1:{port}/v1/traces"

        def send(body: bytes, headers: dict[str, str]) -> int:
            try:
                return post(url, body, headers=headers)[0]
            except OSError:
                return 0  # closed before the whole body was sent (a 413)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            statuses = list(
                pool.map(send, [plain, bomb] * 4, [{}, {"Content-Encoding": "gzip"}] * 4)
            )
            # Then JSON (quick to answer: no 503 from requests queued behind the large ones).
            json_statuses = list(pool.map(send, [dense, fits] * 2, [json_headers] * 4))
        grown = _status_mib(proc.pid, "VmHWM") - before
    finally:
        proc.terminate()
        # More than the 30 s of graceful shutdown: under load (requests answered 503 while their
        # senders still pushed their bodies), one connection was seen to last until then.
        proc.wait(60)
    # 503: waited past the queue timeout (a loaded machine), for a plain request or a bomb alike.
    plain_statuses, bomb_statuses = statuses[0::2], statuses[1::2]
    assert set(plain_statuses) <= {200, 503}, statuses
    assert set(bomb_statuses) <= {413, 503, 0}, statuses
    assert json_statuses == [413, 200] * 2, json_statuses
    assert grown < 2 * 2 * mib + 48, f"peak memory grew by {grown} MiB"


def _json_filler(unit: bytes, size: int) -> bytes:
    """An OTLP/JSON request of about ``size`` bytes, of ``unit`` repeated in an unknown field."""
    head, tail = b'{"resourceSpans":[{"scopeSpans":[{"spans":[],"x":[', b"]}]}]}"
    return head + b",".join([unit] * (size // (len(unit) + 1))) + tail


def test_listening_beyond_loopback_without_a_token_or_tls_warns():
    """Loopback is quiet; any other address warns without tokens, and with tokens but no TLS."""
    from otel_agentcap.ingest.config import exposure_warnings

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert exposure_warnings(host, tokens=False, tls=False) == []
    for host in ("0.0.0.0", "::", "10.1.2.3", "ingest.example"):
        [warning] = exposure_warnings(host, tokens=False, tls=True)
        assert "without a bearer token" in warning
        [warning] = exposure_warnings(host, tokens=True, tls=False)
        assert "without TLS" in warning
        assert exposure_warnings(host, tokens=True, tls=True) == []


def test_tls_on_http_and_grpc(pg_dsn, tmp_path):
    """With a certificate, both receivers speak TLS only: HTTPS and gRPC over TLS store the
    spans, plain HTTP gets no answer."""
    import http.client
    import ssl
    import subprocess

    import grpc

    from otel_agentcap.ingest import TlsConfig
    from otel_agentcap.ingest.grpc_server import METHOD

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    spans, expected = captured("run-tls")
    body = request_bytes(spans)
    with OtlpIngestServer(
        pg_dsn, port=0, grpc_port=0, tls=TlsConfig(str(cert), str(key))
    ) as server:
        assert server.endpoint.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=30)
        conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
        assert conn.getresponse().status == 200
        conn.close()
        assert not raw_exchange(
            server.port, b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n", timeout=3
        ).startswith(b"HTTP/1.1 2")
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{server.grpc_port}", credentials) as channel:
            channel.unary_unary(METHOD)(body, timeout=30)
    assert count(pg_dsn, EVENTS, "run-tls") == expected
