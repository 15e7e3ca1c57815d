"""One call that sets up capture into the PostgreSQL event log."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_agentcap.capture import _telemetry
from otel_agentcap.capture.agents import set_spawn_registry
from otel_agentcap.capture.ledger import set_tool_ledger
from otel_agentcap.capture.runs import set_run_registry
from otel_agentcap.clock import clocks
from otel_agentcap.exporters.postgres import (
    Database,
    PostgresSequenceSource,
    PostgresSpanExporter,
    resolve_dsn,
)
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
from otel_agentcap.exporters.postgres.memory import set_default_database
from otel_agentcap.exporters.postgres.recovery import PostgresRunRegistry, PostgresSpawnRegistry
from otel_agentcap.exporters.queue import EventLogSpanProcessor, Overflow
from otel_agentcap.instrumentation import instrument_installed
from otel_agentcap.processor import AgentCapSpanProcessor
from otel_agentcap.tool_uses import set_sdk_tools_exactly_once


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
    tool_ledger: bool = True,
    sdk_tools_exactly_once: bool | None = None,
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
    * ``tool_ledger``: protect ``Tool.invoke`` calls with the PostgreSQL tool ledger, so an
      invocation runs once across every process serving the run (see the README, Tools).
    * ``sdk_tools_exactly_once``: True makes the anthropic SDK's tool runners and toolsets run each
      tool_use exactly once (like ``Tool.invoke``); False (their default) records every execution
      the SDK makes, as it makes it; None leaves the setting as it is.
    * ``set_global``: install the provider as the global one (capture uses the global provider).
    * ``instrument``: instrument the libraries installed that need it for a full record (see
      :func:`otel_agentcap.instrumentation.instrument_installed`: the anthropic SDK's causal
      links); ``False`` leaves instrumentation to the caller.

    Spawns are registered in the database when they happen, so a spawn retried in any process
    gets the same child and spawn event; ``PostgresMemory`` uses this database by default; a run id
    is claimed in the database when its run opens (``run(run_id)`` on a stored run needs
    ``resume=True`` or a carried context, see ``otel_agentcap.capture.runs``).

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
    set_spawn_registry(PostgresSpawnRegistry(database))
    set_run_registry(PostgresRunRegistry(database))
    set_tool_ledger(PostgresToolLedger(database) if tool_ledger else None)
    set_default_database(database)
    if sdk_tools_exactly_once is not None:
        set_sdk_tools_exactly_once(sdk_tools_exactly_once)
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
