"""Ingest of spans that arrive over OTLP (e.g. from an OpenTelemetry Collector) into the event log.

Its dependencies (opentelemetry-proto, Starlette, Hypercorn, grpcio) come with the default install.
"""

from __future__ import annotations

try:
    from otel_agentcap.ingest.auth import Authenticator, Principal, TokenConfigError
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
    from otel_agentcap.ingest.wire import DecodeError, decode_json, decode_protobuf
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
    if exc.name is None or not exc.name.startswith(
        ("opentelemetry.proto", "google", "grpc", "starlette", "hypercorn", "anyio")
    ):
        raise
    raise ModuleNotFoundError(
        "otel_agentcap.ingest is missing a dependency of the default install; reinstall "
        "otel-agentcap",
        name=exc.name,
    ) from exc

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
    "TlsConfig",
    "TokenConfigError",
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
