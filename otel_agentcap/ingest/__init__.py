"""Ingest of spans that arrive over OTLP (e.g. from an OpenTelemetry Collector) into the event log.

Needs ``opentelemetry-proto`` (``pip install 'otel-agentcap[otlp]'``).
"""

from __future__ import annotations

try:
    from otel_agentcap.ingest.otlp import (
        DEFAULT_HOST,
        DEFAULT_PORT,
        TRACES_PATH,
        IngestStats,
        OtlpIngestServer,
        OtlpScope,
        OtlpSpan,
        OtlpSpanContext,
        OtlpSpanEvent,
        decode_attributes,
        decode_value,
        iter_spans,
        parse_request,
        serve,
        spans_from_otlp,
    )
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
    if exc.name is None or not exc.name.startswith(("opentelemetry.proto", "google")):
        raise
    raise ModuleNotFoundError(
        "otel_agentcap.ingest needs opentelemetry-proto: pip install 'otel-agentcap[otlp]'",
        name=exc.name,
    ) from exc

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TRACES_PATH",
    "IngestStats",
    "OtlpIngestServer",
    "OtlpScope",
    "OtlpSpan",
    "OtlpSpanContext",
    "OtlpSpanEvent",
    "decode_attributes",
    "decode_value",
    "iter_spans",
    "parse_request",
    "serve",
    "spans_from_otlp",
]
