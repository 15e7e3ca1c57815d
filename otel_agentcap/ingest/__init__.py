"""Ingest of spans that arrive over OTLP (e.g. from an OpenTelemetry Collector) into the event log.

Its dependencies (opentelemetry-proto, googleapis-common-protos, Starlette, Hypercorn, grpcio) are
dependencies of the package: the default install runs it.
"""

from __future__ import annotations

from otel_agentcap.ingest.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    TRACES_PATH,
    IngestLimits,
    TlsConfig,
)
from otel_agentcap.ingest.otlp import (
    OtlpScope,
    OtlpSpan,
    OtlpSpanContext,
    OtlpSpanEvent,
    decode_attributes,
    decode_value,
    iter_spans,
    parse_request,
    span_from_proto,
    spans_from_otlp,
)
from otel_agentcap.ingest.server import OtlpIngestServer, serve
from otel_agentcap.ingest.service import IngestStats, Outcome
from otel_agentcap.ingest.wire import (
    DecodeError,
    RequestTooLarge,
    TooManySpans,
    decode_json,
    decode_protobuf,
)
from otel_agentcap.tokens import Authenticator, Principal, TokenConfigError

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TRACES_PATH",
    "Authenticator",
    "DecodeError",
    "IngestLimits",
    "IngestStats",
    "OtlpIngestServer",
    "OtlpScope",
    "OtlpSpan",
    "OtlpSpanContext",
    "OtlpSpanEvent",
    "Outcome",
    "Principal",
    "RequestTooLarge",
    "TlsConfig",
    "TokenConfigError",
    "TooManySpans",
    "decode_attributes",
    "decode_json",
    "decode_protobuf",
    "decode_value",
    "iter_spans",
    "parse_request",
    "serve",
    "span_from_proto",
    "spans_from_otlp",
]
