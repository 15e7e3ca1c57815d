"""One call that sets up capture into the PostgreSQL event log."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_agentcap.capture import _telemetry
from otel_agentcap.capture.agents import set_spawn_lookup
from otel_agentcap.capture.runs import set_run_registry
from otel_agentcap.clock import clocks
from otel_agentcap.exporters.postgres import (
    Database,
    PostgresSequenceSource,
    PostgresSpanExporter,
    resolve_dsn,
)
from otel_agentcap.exporters.postgres.recovery import PostgresRunRegistry, PostgresSpawnLookup
from otel_agentcap.exporters.queue import EventLogSpanProcessor, Overflow
from otel_agentcap.instrumentation import instrument_installed
from otel_agentcap.processor import AgentCapSpanProcessor


def configure(
    dsn: str | None = None,
    *,
    span_processors: Iterable[SpanProcessor] = (),
    service_name: str = "otel-agentcap",
    resource: Resource | None = None,
    set_global: bool = True,
    batch: bool = True,
    queue_size: int | None = None,
    overflow: Overflow = "block",
    sequence_blocks: bool = True,
    announce: bool = True,
    instrument: bool = True,
) -> TracerProvider:
    """Build a TracerProvider that records agents into the PostgreSQL event log.

    * ``dsn``: the database; default ``AGENTCAP_DSN``, else an embedded PostgreSQL (started or
      reused, data under the user's data directory; its location is printed to stderr).
    * ``span_processors``: further processors, e.g.
      ``BatchSpanProcessor(OTLPSpanExporter())`` for a collector; they see agentcap's stamps.
    * ``batch``: export in batches from a queue (default) or synchronously.
    * ``queue_size``, ``overflow``: the export queue's size (default ``OTEL_BSP_MAX_QUEUE_SIZE``,
      else 2,048) and what a full queue does: ``"block"`` (wait up to 2 s for room, then drop) or
      ``"drop"``; drops are counted in ``stats().events_dropped`` (see ``exporters.queue``).
    * ``sequence_blocks``: reserve sequence blocks in the database so that several processes
      serving one agent, or an agent resumed after a restart, never repeat a sequence.
      A spawn retried in a new process finds the child stored by the earlier one, and a run id
      is claimed in the database when its run opens (``run(run_id)`` on a stored run needs
      ``resume=True`` or a carried context, see ``otel_agentcap.capture.runs``).
    * ``set_global``: install the provider as the global one (capture uses the global provider).
    * ``instrument``: instrument the libraries installed that need it for a full record (see
      :func:`otel_agentcap.instrumentation.instrument_installed`: the anthropic SDK's causal
      links); ``False`` leaves instrumentation to the caller.

    Raises only for configuration errors (e.g. the embedded server cannot start); a database that
    is down is waited for in the background.
    """
    database = Database(resolve_dsn(dsn, announce=announce))
    exporter = PostgresSpanExporter(database=database, owns_database=True)
    provider = TracerProvider(
        resource=resource
        if resource is not None
        else Resource.create({"service.name": service_name})
    )
    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(
        EventLogSpanProcessor(
            exporter,
            max_queue_size=queue_size,
            overflow=overflow,
            on_drop=exporter.count_dropped,
        )
        if batch
        else SimpleSpanProcessor(exporter)
    )
    for processor in span_processors:
        provider.add_span_processor(processor)
    if sequence_blocks:
        clocks.configure(PostgresSequenceSource(database))
    set_spawn_lookup(PostgresSpawnLookup(database))
    set_run_registry(PostgresRunRegistry(database))
    _telemetry.refresh_content_capture()
    if set_global:
        trace.set_tracer_provider(provider)
    provider.agentcap_exporter = exporter  # type: ignore[attr-defined]
    if instrument:
        instrument_installed()
    return provider


def exporter_of(provider: TracerProvider) -> PostgresSpanExporter | None:
    """The PostgreSQL exporter that :func:`configure` attached to ``provider``."""
    exporter = getattr(provider, "agentcap_exporter", None)
    return exporter if isinstance(exporter, PostgresSpanExporter) else None
