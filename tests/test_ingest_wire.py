"""ingest.wire: OTLP requests decoded span by span, protobuf and JSON."""

from __future__ import annotations

import base64
import json

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from otel_agentcap.ingest import (
    DecodeError,
    RequestTooLarge,
    TooManySpans,
    decode_json,
    decode_protobuf,
    spans_from_otlp,
)
from otel_agentcap.ingest.wire import json_memory_bound

values = st.one_of(
    st.text(max_size=20).map(lambda s: AnyValue(string_value=s)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
)
attributes = st.lists(st.tuples(st.text(min_size=1, max_size=10), values), max_size=4).map(
    lambda kvs: [KeyValue(key=k, value=v) for k, v in kvs]
)
stamp = st.sampled_from(
    [[], [KeyValue(key="agentcap.event.id", value=AnyValue(string_value="an id"))]]
)
spans = st.builds(
    lambda name, attrs, stamped, n: trace_pb2.Span(
        trace_id=(n + 1).to_bytes(16, "big"),
        span_id=(n + 1).to_bytes(8, "big"),
        name=name,
        attributes=stamped + attrs,
        start_time_unix_nano=1_700_000_000_000_000_000 + n,
        end_time_unix_nano=1_700_000_001_000_000_000,
    ),
    st.text(max_size=20),
    attributes,
    stamp,
    st.integers(0, 2**60),
)
requests = st.lists(
    st.tuples(
        attributes,
        st.lists(st.tuples(st.text(max_size=10), st.lists(spans, max_size=4)), max_size=3),
    ),
    max_size=3,
).map(
    lambda resources: ExportTraceServiceRequest(
        resource_spans=[
            {
                "resource": {"attributes": resource},
                "scope_spans": [
                    {"scope": {"name": scope}, "spans": scope_spans}
                    for scope, scope_spans in scopes
                ],
            }
            for resource, scopes in resources
        ]
    )
)


def _key(span) -> tuple[object, ...]:
    """A span's fields (``Status`` has no equality of its own)."""
    status = span.status
    return (
        span.name,
        span.context,
        span.parent,
        span.kind,
        span.attributes,
        span.events,
        span.start_time,
        span.end_time,
        status.status_code,
        status.description,
        span.instrumentation_scope,
        span.resource_attributes,
    )


def _decoded(request) -> list[object]:
    return [_key(span) if span is not None else reason for span, reason in request.items()]


def _expected(span) -> object:
    """A span of a whole parse as span-by-span decoding gives it: spans without an agentcap
    event id are not converted (None)."""
    return _key(span) if "agentcap.event.id" in span.attributes else None


def _as_json(request: ExportTraceServiceRequest) -> bytes:
    data = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in data.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(data).encode()


@settings(max_examples=60, deadline=None)
@given(requests)
def test_span_by_span_decoding_matches_a_whole_parse(request):
    """Protobuf and OTLP/JSON requests decoded span by span give exactly the spans of a parse of
    the whole message, in order, with every resource and scope."""
    data = request.SerializeToString()
    expected = [_expected(span) for span in spans_from_otlp(data)]
    decoded = decode_protobuf(data)
    assert decoded.count == len(expected)
    assert _decoded(decoded) == expected
    assert _decoded(decode_json(_as_json(request))) == expected


@settings(max_examples=40, deadline=None)
@given(requests.filter(lambda r: r.ByteSize() > 2), st.data())
def test_a_request_cut_inside_a_field_is_refused_whole(request, data):
    """A body cut inside its last top-level field raises DecodeError before any span is given."""
    body = request.SerializeToString()
    last = request.resource_spans[-1].SerializeToString()
    cut = data.draw(st.integers(len(body) - len(last), len(body) - 1))
    with pytest.raises(DecodeError):
        decode_protobuf(body[:cut])


def test_unknown_fields_are_skipped_and_a_bad_span_is_rejected_alone():
    """Unknown fields of the request are skipped; a span whose bytes do not parse, or whose ids
    are not 16 and 8 bytes, is given with a reason while the others are decoded."""
    stamped = [KeyValue(key="agentcap.event.id", value=AnyValue(string_value="x"))]
    good = trace_pb2.Span(trace_id=b"\1" * 16, span_id=b"\2" * 8, name="good", attributes=stamped)
    short = trace_pb2.Span(
        trace_id=b"\1" * 15, span_id=b"\2" * 8, name="short ids", attributes=stamped
    )
    request = ExportTraceServiceRequest(
        resource_spans=[{"scope_spans": [{"spans": [good, short]}]}]
    )
    body = request.SerializeToString()
    # An unknown top-level varint field (number 99) after the spans.
    items = list(decode_protobuf(body + b"\x98\x06\x01").items())
    assert [span.name if span else reason for span, reason in items] == [
        "good",
        "span cannot be stored: trace id is 15 bytes, not 16",
    ]
    scope = trace_pb2.ScopeSpans(spans=[good]).SerializeToString()
    bad_span = b"\x12\x03\x0a\x05x"  # field 2 (span) of 3 bytes holding a truncated field
    resource_spans = b"\x12" + bytes([len(scope + bad_span)]) + scope + bad_span
    body = b"\x0a" + bytes([len(resource_spans)]) + resource_spans
    items = list(decode_protobuf(body).items())
    assert items[0][0] is not None and items[0][0].name == "good"
    assert items[1][0] is None and "does not parse" in str(items[1][1])


@pytest.mark.parametrize(
    ("parent", "reason"),
    [
        (b"\3" * 100, "span cannot be stored: parent span id is 100 bytes, not 8"),
        (b"\3" * 7, "span cannot be stored: parent span id is 7 bytes, not 8"),
        (b"", None),
        (b"\0" * 8, None),
        (b"\3" * 8, None),
    ],
)
def test_a_malformed_parent_span_id_rejects_the_span_with_a_reason(parent, reason):
    """A span whose parent span id is neither empty (a root) nor 8 bytes is given with a reason,
    in protobuf and in OTLP/JSON, not read as a root span with its parent dropped; 8 zero bytes
    read as no parent."""
    stamped = [KeyValue(key="agentcap.event.id", value=AnyValue(string_value="x"))]
    span = trace_pb2.Span(
        trace_id=b"\1" * 16, span_id=b"\2" * 8, parent_span_id=parent, attributes=stamped
    )
    request = ExportTraceServiceRequest(resource_spans=[{"scope_spans": [{"spans": [span]}]}])
    for decoded in (decode_protobuf(request.SerializeToString()), decode_json(_as_json(request))):
        [(converted, why)] = list(decoded.items())
        assert why == reason
        if reason is None:
            assert converted is not None
            expected = int.from_bytes(parent, "big") or None
            assert (converted.parent.span_id if converted.parent else None) == expected


def test_json_that_is_not_a_request_is_refused():
    """JSON that is not an object, or whose resourceSpans is not an array, raises DecodeError;
    a span with an id that is not hex is rejected alone."""
    for text in (b"[]", b"{not json", b'{"resourceSpans": 5}'):
        with pytest.raises(DecodeError):
            decode_json(text)
    body = json.dumps(
        {
            "resourceSpans": [
                {
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    "traceId": "zz",
                                    "spanId": "01",
                                    "attributes": [
                                        {"key": "agentcap.event.id", "value": {"stringValue": "x"}}
                                    ],
                                }
                            ]
                        }
                    ]
                }
            ]
        }
    ).encode()
    [(span, reason)] = list(decode_json(body).items())
    assert span is None and "not hex" in str(reason)


def test_json_null_lists_are_empty_lists():
    """A null resourceSpans, scopeSpans or spans is an empty list, as protobuf's JSON mapping
    reads null; the spans next to it are decoded, and the request is not refused whole."""
    span = {
        "traceId": "0102030405060708090a0b0c0d0e0f10",
        "spanId": "0102030405060708",
        "attributes": [{"key": "agentcap.event.id", "value": {"stringValue": "x"}}],
    }
    body = json.dumps(
        {
            "resourceSpans": [
                {"resource": None, "scopeSpans": None},
                {"scopeSpans": [{"scope": None, "spans": None}, {"spans": [span]}]},
            ]
        }
    ).encode()
    decoded = decode_json(body)
    [(converted, reason)] = list(decoded.items())
    assert decoded.count == 1 and reason is None and converted is not None
    assert decode_json(b'{"resourceSpans": null}').count == 0


def _delimited(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    out = bytearray([number << 3 | 2])
    length = len(payload)
    while length >= 0x80:
        out.append(length & 0x7F | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out) + payload


@pytest.mark.parametrize("shape", ["spans", "scopes", "resources"])
def test_the_index_of_a_request_of_tiny_spans_is_smaller_than_the_request(shape):
    """decode_protobuf keeps no per-span or per-scope index: a request of 200,000 empty spans
    (two to eight bytes each: in one scope, each in its own scope, each in its own resource)
    allocates less than its own size while decoded and held, where 16 bytes of offsets a span
    (or a few hundred bytes a scope) made a 64 MiB body cost gigabytes."""
    import tracemalloc

    span = _delimited(2, b"")
    n = 200_000
    if shape == "spans":
        body = _delimited(1, _delimited(2, span * n))
    elif shape == "scopes":
        body = _delimited(1, _delimited(2, span) * n)
    else:
        body = _delimited(1, _delimited(2, span)) * n
    tracemalloc.start()
    try:
        decoded = decode_protobuf(body, max_spans=3 * n)  # resources, scopes: up to 2 * n entries
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoded.count == n
    assert peak < len(body), f"{peak} bytes allocated for a body of {len(body)}"
    assert sum(1 for _ in decoded.items()) == n


def test_span_events_the_log_does_not_read_are_not_kept():
    """A stamped span with 60,000 span events of other instrumentations (two bytes each on the
    wire; under the 65,536 elements a span may hold) is decoded without keeping them (the mapping reads only agentcap's own span events):
    the decoded spans of a chunk cannot hold a hundred times the request's size. agentcap's
    span events are kept."""
    import tracemalloc

    stamped = trace_pb2.Span(
        trace_id=b"\1" * 16,
        span_id=b"\1" * 8,
        attributes=[KeyValue(key="agentcap.event.id", value=AnyValue(string_value="x"))],
        events=[trace_pb2.Span.Event(name="agentcap.tool_result", time_unix_nano=5)],
    ).SerializeToString()
    n = 60_000
    body = _delimited(1, _delimited(2, _delimited(2, stamped + _delimited(11, b"") * n)))
    tracemalloc.start()
    try:
        [(span, reason)] = list(decode_protobuf(body).items())
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reason is None and span is not None
    assert [event.name for event in span.events] == ["agentcap.tool_result"]
    # Kept, the events would take about 100 bytes each: 50 times the body.
    assert held < 2 * len(body), f"{held} bytes held for a body of {len(body)}"


@pytest.mark.parametrize("shape", ["spans", "scopes", "resources", "unknown fields"])
def test_a_request_of_more_entries_than_the_limit_is_refused_whole(shape):
    """A request of more than ``max_spans`` spans, or of as many scopes, resources or unknown
    fields around them (two bytes each: millions fit in a few MiB, and each costs CPU to walk),
    raises TooManySpans from decode_protobuf, before any span is given; the walk stops at the
    limit. A request of exactly the limit is decoded."""
    span = _delimited(2, b"")
    limit = 1_000

    def body(n: int) -> bytes:
        if shape == "spans":
            return _delimited(1, _delimited(2, span * n))
        if shape == "scopes":
            return _delimited(1, _delimited(2, span) * n)
        if shape == "resources":
            return _delimited(1, _delimited(2, span)) * n
        return _delimited(1, _delimited(2, span) + b"\x18\x00" * n)

    with pytest.raises(TooManySpans, match="more than 1000 spans"):
        decode_protobuf(body(10 * limit), max_spans=limit)
    if shape == "spans":
        assert decode_protobuf(body(limit), max_spans=limit).count == limit


def test_a_json_request_of_more_spans_than_the_limit_is_refused_whole():
    """decode_json raises TooManySpans for more than ``max_spans`` spans."""
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{}] * 11}]}]}).encode()
    with pytest.raises(TooManySpans):
        decode_json(body, max_spans=10)
    assert decode_json(body, max_spans=11).count == 11


def _json_filler(unit: bytes, size: int) -> bytes:
    """An OTLP/JSON request of about ``size`` bytes, of ``unit`` repeated in an unknown field."""
    head, tail = b'{"resourceSpans":[{"scopeSpans":[{"spans":[],"x":[', b"]}]}]}"
    return head + b",".join([unit] * (size // (len(unit) + 1))) + tail


_DENSE_JSON = {
    "empty objects": b"{}",
    "one-key objects": b'{"":0}',
    "nested objects": b'{"":{"":{"":{}}}}',
    "deeply nested objects": b'{"":' * 500 + b"0" + b"}" * 500,
    "empty arrays": b"[]",
    "deeply nested arrays": b"[" * 500 + b"]" * 500,
    "short strings": b'"ab"',
    "strings outside Latin-1": '"\U0001f600\U0001f600"'.encode(),
    "negative ints": b"-7",
    "floats in objects": b'{"a":1e5,"b":1e5,"c":1e5}',
    "wide objects": b"{" + b",".join(b'"%d":%d' % (i, 1000 + i) for i in range(20_000)) + b"}",
}


@pytest.mark.parametrize("shape", sorted(_DENSE_JSON))
def test_the_json_memory_bound_holds_and_refuses_dense_requests(shape):
    """What decoding an OTLP/JSON request allocates at its peak (tracemalloc, 2 MiB of JSON of
    each dense shape: 13 to 45 times its size) stays under json_memory_bound, which is known
    before parsing; decode_json with a max_memory under that bound refuses the request
    (RequestTooLarge) before parsing it."""
    import tracemalloc

    body = bytearray(_json_filler(_DENSE_JSON[shape], 2 * 1024 * 1024))
    bound = json_memory_bound(body)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in decode_json(body).items():
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before <= bound, f"{peak - before} bytes allocated, bound {bound}"
    with pytest.raises(RequestTooLarge, match="could take"):
        decode_json(body, max_memory=bound - 1)
    assert decode_json(body, max_memory=bound).count == 0


def test_ordinary_json_spans_are_bounded_near_what_they_take():
    """For ordinary OTLP/JSON spans the bound is at most 20 times the body (they take about 6),
    so the ingest's default (2 x the 64 MiB protobuf limit) takes such requests up to 6 MiB."""
    span = {
        "traceId": "0102030405060708090a0b0c0d0e0f10",
        "spanId": "0102030405060708",
        "name": "model_call",
        "kind": 1,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000001000000000",
        "attributes": [
            {"key": f"agentcap.attribute.{i}", "value": {"stringValue": "x" * 40}}
            for i in range(20)
        ],
    }
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span] * 2000}]}]}).encode()
    assert json_memory_bound(body) <= 20 * len(body)


def test_a_span_of_too_many_attributes_or_values_is_rejected_alone_unparsed():
    """A large span (over 64 KiB) of more than 65,536 attributes, events, links and values in
    all (empty attributes, or one attribute of an array of empty values: two bytes each, where
    each parsed costs about 56) is rejected alone without being parsed; a large span of one long
    value and a small one beside them are decoded."""
    stamp = KeyValue(key="agentcap.event.id", value=AnyValue(string_value="x")).SerializeToString()

    def span(extra: bytes) -> bytes:
        ids = b"\x0a\x10" + b"\1" * 16 + b"\x12\x08" + b"\1" * 8
        return _delimited(2, ids + _delimited(9, stamp) + extra)

    many = 70_000
    attributes = _delimited(9, b"") * many
    array = _delimited(9, _delimited(1, b"k") + _delimited(2, _delimited(5, b"\x0a\x00" * many)))
    long_value = _delimited(9, _delimited(1, b"k") + _delimited(2, _delimited(1, b"v" * 200_000)))
    body = _delimited(
        1, _delimited(2, span(attributes) + span(array) + span(long_value) + span(b""))
    )
    items = list(decode_protobuf(body).items())
    assert [reason is None for _, reason in items] == [False, False, True, True]
    assert "more than 65536 attributes, events, links and values" in str(items[0][1])
    assert "more than 65536" in str(items[1][1])
    assert items[2][0] is not None and len(items[2][0].attributes["k"]) == 200_000
