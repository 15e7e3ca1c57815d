"""Decode OTLP trace requests span by span, in bounded memory.

An ``ExportTraceServiceRequest`` is parsed lazily: :func:`decode_protobuf` first walks the
request's framing (resource spans, scope spans, the length of each span) over the body without
copying it, and fails with ``DecodeError`` if the framing is broken anywhere, before anything is
stored; then :meth:`DecodedRequest.items` walks it again and parses one span at a time. No index
of spans or scopes is kept, so a 64 MB request costs about its own size, not the two to three
times more of a whole-message parse (nor gigabytes of offsets for a request of millions of empty
spans or scopes, which gzip sends in kilobytes), and a span whose own bytes do not parse is
rejected alone. :func:`decode_json` reads OTLP/JSON (hex trace
and span ids, as the OTLP specification maps them), also span by span.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from google.protobuf import json_format
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2

from otel_agentcap.ingest.otlp import (
    FOR_THE_LOG,
    OtlpScope,
    OtlpSpan,
    decode_attributes,
    id_problem,
    span_from_proto,
)

Buffer = bytes | bytearray | memoryview


class DecodeError(ValueError):
    """The request is not an OTLP trace request (its framing, or its JSON, is broken)."""


class RequestTooLarge(DecodeError):
    """The request is more than one request may be: refused whole, before any span is stored.
    Retrying it cannot help (HTTP 413; gRPC ``RESOURCE_EXHAUSTED`` without ``RetryInfo``)."""


class TooManySpans(RequestTooLarge):
    """The request holds more spans (or more resources, scopes and other entries around them)
    than one request may."""


#: Spans one request may hold unless the caller says otherwise (``IngestLimits.max_spans``).
DEFAULT_MAX_SPANS: Final = 100_000


def _too_many(max_spans: int) -> TooManySpans:
    return TooManySpans(
        f"the request holds more than {max_spans} spans (or more than {max_spans} resources, "
        "scopes and other entries); send smaller requests (a collector's batch processor: "
        f"send_batch_max_size of at most {max_spans})"
    )


# --- protobuf wire format ---------------------------------------------------------------------

_MAX_VARINT_BYTES: Final = 10


def _varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    for _ in range(_MAX_VARINT_BYTES):
        if pos >= end:
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise DecodeError("varint longer than 10 bytes")


def _fields(buf: Buffer, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """The fields of the message in ``buf[start:end]``: (number, wire type, value start, value
    end); for length-delimited fields the value is the payload, for others it is skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire_type == 0:
            _, value_end = _varint(buf, pos, end)
            value_start = pos
        elif wire_type == 2:
            length, value_start = _varint(buf, pos, end)
            value_end = value_start + length
        elif wire_type == 1:
            value_start, value_end = pos, pos + 8
        elif wire_type == 5:
            value_start, value_end = pos, pos + 4
        else:
            raise DecodeError(f"unsupported wire type {wire_type}")
        if value_end > end:
            raise DecodeError("field runs past the end of its message")
        yield number, wire_type, value_start, value_end
        pos = value_end


def _message_field(number: int, wire_type: int, what: str) -> bool:
    if wire_type != 2:
        raise DecodeError(f"{what} (field {number}) is not length-delimited")
    return True


#: An item of a decoded request: the span, or why it cannot be read, or (None, None) for a
#: span without an agentcap event id that is no run's root span (not converted: it is not for
#: the log).
Item = tuple[OtlpSpan | None, str | None]


class DecodedRequest:
    """The spans of one OTLP request, read one by one (see :meth:`items`)."""

    def __init__(
        self, count: int, items: Callable[[], Iterator[Item]], body: Buffer | None = None
    ) -> None:
        self.count = count
        self._items = items
        #: The protobuf request the spans come from (None for OTLP/JSON).
        self.body = body

    def items(self) -> Iterator[Item]:
        """Each span in request order: ``(span, None)``; ``(None, reason)`` for a span that
        cannot be read (its bytes are not a ``Span``, or its ids are invalid); ``(None, None)``
        for a span without ``agentcap.event.id``, which is not converted."""
        return self._items()


def _merged(message_type: Any, buf: Buffer, start: int, end: int) -> Any:
    """The message in field 1 of the message in ``buf[start:end]`` (a resource of its resource
    spans, a scope of its scope spans), merged from every occurrence, as protobuf merges them."""
    message = message_type()
    view = memoryview(buf)
    try:
        for number, _, value_start, value_end in _fields(buf, start, end):
            if number == 1:
                message.MergeFromString(view[value_start:value_end])
    except DecodeError:
        raise
    except Exception as exc:  # google.protobuf.message.DecodeError, which ships no stubs
        raise DecodeError(f"{message_type.__name__} does not parse: {exc}") from exc
    return message


def _scope_of(message: InstrumentationScope) -> OtlpScope:
    return OtlpScope(message.name, message.version or None)


def _checked(buf: Buffer, max_spans: int) -> int:
    """The number of spans of the request in ``buf``; raises ``DecodeError`` when its framing,
    a resource or a scope is broken, ``TooManySpans`` once it holds more than ``max_spans``
    spans or more than ``max_spans`` other entries (the walk stops there: what a request costs
    to check is bounded by the limit, not by how many two-byte entries its body can hold).
    Nothing is kept: a request of many tiny spans or scopes costs no index (``decode_protobuf``
    walks the request again as it gives the spans)."""
    count = 0
    others = 0
    for number, wire_type, start, end in _fields(buf, 0, len(buf)):
        others += 1
        if others > max_spans:
            raise _too_many(max_spans)
        if number != 1 or not _message_field(number, wire_type, "resource_spans"):
            continue
        for n2, w2, s2, e2 in _fields(buf, start, end):
            others += 1
            if others > max_spans:
                raise _too_many(max_spans)
            if n2 == 1:
                _message_field(n2, w2, "resource")
            elif n2 == 2 and _message_field(n2, w2, "scope_spans"):
                for n3, w3, _, _ in _fields(buf, s2, e2):
                    if n3 == 2 and _message_field(n3, w3, "span"):
                        count += 1
                        if count > max_spans:
                            raise _too_many(max_spans)
                    else:
                        others += 1
                        if others > max_spans:
                            raise _too_many(max_spans)
                        if n3 == 1:
                            _message_field(n3, w3, "scope")
                _merged(InstrumentationScope, buf, s2, e2)
        _merged(Resource, buf, start, end)
    return count


#: A span larger than this is walked before it is parsed: its attributes, events, links and the
#: values in them are counted, as parsing it makes an object of each (about 56 bytes, against
#: two bytes on the wire: one span of 8 million empty attributes, 15 MiB, took 430 MiB).
_WALK_BYTES: Final = 64 * 1024
#: Attributes, events, links and values (counted recursively) one span may hold; the SDK's
#: default limits (128 attributes, events and links, 128 attributes each) stay far below.
MAX_SPAN_ELEMENTS: Final = 65_536
#: Elements walked in all of a request's large spans: what walking costs stays bounded.
_MAX_WALKED_ELEMENTS: Final = 1_000_000

# The message fields of the messages inside a span, by field number (for counting).
_SPAN, _KEY_VALUE, _ANY_VALUE, _ARRAY, _KV_LIST, _EVENT, _LINK = range(7)
_CHILDREN: Final[dict[int, dict[int, int]]] = {
    _SPAN: {9: _KEY_VALUE, 11: _EVENT, 13: _LINK},
    _EVENT: {3: _KEY_VALUE},
    _LINK: {4: _KEY_VALUE},
    _KEY_VALUE: {2: _ANY_VALUE},
    _ANY_VALUE: {5: _ARRAY, 6: _KV_LIST},
    _ARRAY: {1: _ANY_VALUE},
    _KV_LIST: {1: _KEY_VALUE},
}


def _elements(buf: Buffer, start: int, end: int, budget: int) -> int:
    """The fields of the span in ``buf[start:end]``, counted into its attributes, events, links
    and values; stops once over ``budget`` (raises ``DecodeError`` on broken framing)."""
    count = 0
    stack = [(start, end, _SPAN)]
    while stack:
        first, last, kind = stack.pop()
        children = _CHILDREN.get(kind)
        for number, wire_type, value_start, value_end in _fields(buf, first, last):
            count += 1
            if count > budget:
                return count
            if children is not None and wire_type == 2:
                child = children.get(number)
                if child is not None:
                    stack.append((value_start, value_end, child))
    return count


def decode_protobuf(buf: Buffer, max_spans: int = DEFAULT_MAX_SPANS) -> DecodedRequest:
    """A binary ``ExportTraceServiceRequest``; raises ``DecodeError`` when its framing, a
    resource or a scope is broken (all checked before any span is returned), ``TooManySpans``
    when it holds more than ``max_spans`` spans (or other entries)."""
    count = _checked(buf, max_spans)

    def items() -> Iterator[Item]:
        # The framing was checked whole: walked again, it holds.
        view = memoryview(buf)
        walked = 0
        for number, _, start, end in _fields(buf, 0, len(buf)):
            if number != 1:
                continue
            resource: Mapping[str, Any] | None = None
            for n2, _, s2, e2 in _fields(buf, start, end):
                if n2 != 2:
                    continue
                if resource is None:
                    resource = decode_attributes(_merged(Resource, buf, start, end).attributes)
                scope = _scope_of(_merged(InstrumentationScope, buf, s2, e2))
                for n3, _, s3, e3 in _fields(buf, s2, e2):
                    if n3 != 2:
                        continue
                    if e3 - s3 > _WALK_BYTES:
                        budget = max(0, min(MAX_SPAN_ELEMENTS, _MAX_WALKED_ELEMENTS - walked))
                        try:
                            elements = _elements(buf, s3, e3, budget)
                        except DecodeError as exc:
                            yield None, f"span does not parse as an OTLP Span: {exc}"
                            continue
                        walked += min(elements, budget)
                        if elements > budget:
                            yield (
                                None,
                                (
                                    f"span holds more than {MAX_SPAN_ELEMENTS} attributes, events, "
                                    "links and values"
                                    if budget == MAX_SPAN_ELEMENTS
                                    else "the request's large spans hold more than "
                                    f"{_MAX_WALKED_ELEMENTS} attributes, events, links and values"
                                ),
                            )
                            continue
                    try:
                        # A view, not a copy: upb parses any buffer.
                        span = trace_pb2.Span.FromString(view[s3:e3])
                    except Exception as exc:  # DecodeError (no stubs)
                        yield None, f"span does not parse as an OTLP Span: {exc}"
                        continue
                    yield _converted(span, scope, resource)

    return DecodedRequest(count, items, buf)


def _converted(span: trace_pb2.Span, scope: OtlpScope, resource: Mapping[str, Any]) -> Item:
    if not any(kv.key in FOR_THE_LOG for kv in span.attributes):
        return None, None
    try:
        converted = span_from_proto(span, scope, resource, all_events=False)
    except Exception as exc:  # a value the conversion cannot take
        return None, f"span cannot be read: {type(exc).__name__}: {exc}"
    if converted is None:
        return None, f"span cannot be stored: {id_problem(span)}"
    return converted, None


# --- OTLP/JSON --------------------------------------------------------------------------------

_ID_FIELDS: Final = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def _hex_ids(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with its hex trace and span ids in the base64 form protobuf's JSON mapping reads."""
    out = dict(obj)
    for name in _ID_FIELDS:
        value = out.get(name)
        if isinstance(value, str) and value:
            try:
                raw = bytes.fromhex(value)
            except ValueError as exc:
                raise ValueError(f"{name} is not hex") from exc
            out[name] = base64.b64encode(raw).decode("ascii")
    return out


def _span_from_json(obj: object) -> trace_pb2.Span:
    if not isinstance(obj, dict):
        raise ValueError("a span is not a JSON object")
    span = _hex_ids(obj)
    links = span.get("links")
    if isinstance(links, list):
        span["links"] = [_hex_ids(link) if isinstance(link, dict) else link for link in links]
    parsed: trace_pb2.Span = json_format.ParseDict(
        span, trace_pb2.Span(), ignore_unknown_fields=True
    )
    return parsed


def _json_list(obj: Mapping[str, Any], camel: str, snake: str) -> list[Any]:
    """The list in ``camel`` (or ``snake``); absent or null is empty, as protobuf's JSON
    mapping reads null."""
    value = obj.get(camel)
    if value is None:
        value = obj.get(snake)
    if value is None:
        return []
    if not isinstance(value, list):
        raise DecodeError(f"{camel} is not an array")
    return value


def _json_message(obj: Mapping[str, Any], name: str, message_type: Any) -> Any:
    value = obj.get(name)
    if value is None:
        return message_type()
    if not isinstance(value, dict):
        raise DecodeError(f"{name} is not an object")
    try:
        return json_format.ParseDict(value, message_type(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise DecodeError(f"{name} does not parse: {exc}") from exc


def json_memory_bound(text: Buffer) -> int:
    """Bytes that ``json.loads(text)`` can take at most (its Python objects, and the text decoded
    to ``str``), from counts of the characters that open its values, so without parsing it.

    Measured, per byte of JSON: 6 for ordinary OTLP/JSON spans, but 25 for arrays of empty objects
    and 36 to 45 for objects or arrays nested in one another; this bound is 16, 83, 75 and 35 to
    96 for them. An object costs at most 184 bytes (a dict of up to five keys), an array 88 (with
    the room ``append`` leaves), a string 51 plus its characters (the quotes count half each), a
    pair or an element a slot and at most a number (colons and commas), a character of the text
    1 byte, or 4 once the text holds one outside Latin-1 (and as much again for the strings)."""
    data = text if isinstance(text, bytes | bytearray) else bytes(text)
    count = data.count
    per_char = 3 if data.isascii() else 9
    return (
        192 * count(b"{")
        + 96 * count(b"[")
        + 32 * count(b'"')
        + 96 * count(b":")
        + 48 * count(b",")
        + per_char * len(data)
    )


def decode_json(
    text: Buffer, max_spans: int = DEFAULT_MAX_SPANS, max_memory: int | None = None
) -> DecodedRequest:
    """An OTLP/JSON ``ExportTraceServiceRequest``; raises ``DecodeError`` when it is not JSON or
    not shaped like one (a span that does not parse is rejected alone), ``TooManySpans`` when it
    holds more than ``max_spans`` spans (or resources and scopes), ``RequestTooLarge`` when its
    decoded form could take more than ``max_memory`` bytes (:func:`json_memory_bound`: checked
    before it is parsed)."""
    if max_memory is not None:
        bound = json_memory_bound(text)
        if bound > max_memory:
            raise RequestTooLarge(
                f"this OTLP/JSON request could take {bound} bytes decoded, over the "
                f"{max_memory} allowed ({len(text)} bytes of JSON, dense in objects, arrays or "
                "short strings); send smaller requests, or protobuf"
            )
    try:
        # bytes or bytearray as they are (json decodes them to str itself): no copy.
        root = json.loads(text if isinstance(text, bytes | bytearray) else bytes(text))
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"not JSON: {exc}") from exc
    if not isinstance(root, dict):
        raise DecodeError("not a JSON object")
    entries: list[tuple[dict[str, Any], OtlpScope, list[Any]]] = []
    count = 0
    for resource_spans in _json_list(root, "resourceSpans", "resource_spans"):
        if not isinstance(resource_spans, dict):
            raise DecodeError("resourceSpans holds something other than objects")
        resource = decode_attributes(_json_message(resource_spans, "resource", Resource).attributes)
        for scope_spans in _json_list(resource_spans, "scopeSpans", "scope_spans"):
            if not isinstance(scope_spans, dict):
                raise DecodeError("scopeSpans holds something other than objects")
            scope = _scope_of(_json_message(scope_spans, "scope", InstrumentationScope))
            spans = _json_list(scope_spans, "spans", "spans")
            entries.append((resource, scope, spans))
            count += len(spans)
            if count > max_spans or len(entries) > max_spans:
                raise _too_many(max_spans)
    del root

    def items() -> Iterator[Item]:
        for resource, scope, spans in entries:
            for obj in spans:
                try:
                    span = _span_from_json(obj)
                except (json_format.ParseError, ValueError, TypeError, binascii.Error) as exc:
                    yield None, f"span does not parse as OTLP/JSON: {exc}"
                    continue
                yield _converted(span, scope, resource)

    return DecodedRequest(count, items)
