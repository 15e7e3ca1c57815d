"""One call that sets up capture into the PostgreSQL event log, and the handle it returns."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import psycopg
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider

from otel_agentcap.capture import _telemetry
from otel_agentcap.capture.agents import set_spawn_registry, spawn_registry
from otel_agentcap.capture.ledger import set_tool_ledger
from otel_agentcap.capture.ledger import tool_ledger as current_tool_ledger
from otel_agentcap.capture.runs import run_registry, set_run_registry
from otel_agentcap.capture.tool_uses import sdk_tools_exactly_once as current_sdk_tools_exactly_once
from otel_agentcap.capture.tool_uses import set_sdk_tools_exactly_once
from otel_agentcap.clock import SequenceSource, clocks
from otel_agentcap.errors import ConfigurationError
from otel_agentcap.exporters import metrics
from otel_agentcap.exporters.durable.directory import (
    QueueDirectory,
    default_base_dir,
    target_of,
)
from otel_agentcap.exporters.durable.host_sequences import (
    HostAwareSequenceSource,
    HostSequenceStore,
)
from otel_agentcap.exporters.durable.host_spawns import HostAwareSpawnRegistry, HostSpawnStore
from otel_agentcap.exporters.durable.processor import (
    DEFAULT_SHUTDOWN_TIMEOUT,
    DurableSpanProcessor,
    QueueSettings,
    ShutdownReport,
)
from otel_agentcap.exporters.durable.queue import (
    DEFAULT_MAX_BYTES,
    FSYNC_POLICIES,
    OVERFLOW_POLICIES,
    FsyncPolicy,
)
from otel_agentcap.exporters.faults import FaultLog
from otel_agentcap.exporters.postgres import (
    Database,
    PostgresSequenceSource,
    PostgresSpanExporter,
    resolve_dsn,
)
from otel_agentcap.exporters.postgres.connection import first_line
from otel_agentcap.exporters.postgres.errors import AgentCapStorageError
from otel_agentcap.exporters.postgres.exporter import DATABASE_CONDITION, ExportStats
from otel_agentcap.exporters.postgres.ledger import PostgresToolLedger
from otel_agentcap.exporters.postgres.memory import default_database, set_default_database
from otel_agentcap.exporters.postgres.migrate import migrate, pending_versions
from otel_agentcap.exporters.postgres.recovery import PostgresRunRegistry, PostgresSpawnRegistry
from otel_agentcap.exporters.queue import EventLogSpanProcessor, Overflow
from otel_agentcap.exporters.synchronous import SynchronousSpanProcessor
from otel_agentcap.instrumentation import instrument_installed
from otel_agentcap.pipeline.limits import LimitedView, needs_view, provider_limits
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor
from otel_agentcap.pipeline.sampling import configured_sampler
from otel_agentcap.protocols import SpawnRegistry

_logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME: Final = "otel-agentcap"


def _resource(service_name: str | None) -> Resource:
    """The environment's resource (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``), with
    ``service_name`` when given, else ``DEFAULT_SERVICE_NAME`` when the environment names no
    service (the SDK would say ``unknown_service``)."""
    if service_name is not None:
        return Resource.create({"service.name": service_name})
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    return resource


def _check_no_global_provider() -> None:
    """Raise ``ConfigurationError`` when a global TracerProvider is set already: OpenTelemetry
    keeps the first one, so capture (and the SDKs' own tracing) would go to it, and the
    provider configure() builds would record nothing."""
    current = trace.get_tracer_provider()
    if isinstance(current, trace.ProxyTracerProvider):
        return
    if isinstance(current, TracerProvider) and current in _handles:
        raise ConfigurationError(
            "configure() was called before in this process, and OpenTelemetry keeps the first "
            "global TracerProvider: use the handle it returned (a shut down one cannot record "
            "again; start a new process)"
        )
    raise ConfigurationError(
        f"a global TracerProvider is set already ({type(current).__module__}."
        f"{type(current).__qualname__}), and OpenTelemetry keeps the first one, so the provider "
        "configure() builds would record nothing: call configure() before anything sets one "
        "(under opentelemetry-instrument, set OTEL_PYTHON_DISTRO=agentcap; see the README, "
        "Troubleshooting)"
    )


#: Messages of connection failures that are the user's to fix, not a server that is down.
_USER_ERRORS: Final = (
    "does not exist",
    "authentication failed",
    "no pg_hba.conf entry",
    "no password supplied",
    "permission denied",
    "is not permitted to log in",
    "invalid connection option",
    # sslmode=require (or verify-*) against a server without SSL: waiting will not change it.
    "does not support SSL",
)


@dataclass(frozen=True)
class _Installed:
    """A process-wide setting :func:`configure` installed, and what it replaced."""

    current: Callable[[], Any]
    setter: Callable[[Any], None]
    value: Any
    previous: Any

    @classmethod
    def install(
        cls, current: Callable[[], Any], setter: Callable[[Any], None], value: Any
    ) -> _Installed:
        previous = current()
        setter(value)
        return cls(current, setter, value, previous)

    def restore(self) -> None:
        """Put the previous value back, unless something else replaced ours meanwhile."""
        if self.current() is self.value:
            self.setter(self.previous)


class AgentCap:
    """What :func:`configure` set up: the TracerProvider, the PostgreSQL exporter, the durable
    queue, and their figures. Use it to flush, to shut down, and to read :meth:`stats`.

    It owns what it installed: :meth:`shutdown` flushes and stops its processors, closes the
    tool ledger (writing the outcomes it still holds), the host's sequence store and the
    database with its pools, and takes its sequence source, spawn and run registries, tool
    ledger, default memory database and SDK tool setting out of the process-wide settings,
    restoring what they were (so what runs later does not use a closed database). Usable as a
    context manager.

    For code written against earlier versions, where ``configure()`` returned the
    ``TracerProvider``, the handle also answers ``get_tracer``, ``force_flush``, ``shutdown``
    and any other attribute of the provider; new code uses :attr:`provider`.
    """

    def __init__(
        self,
        provider: TracerProvider,
        exporter: PostgresSpanExporter,
        database: Database,
        *,
        queue: DurableSpanProcessor | None,
        export_processor: SpanProcessor,
        faults: FaultLog,
        installed_source: SequenceSource | None,
        previous_source: tuple[SequenceSource | None, int] | None,
        installed: list[_Installed],
        ledger: PostgresToolLedger | None,
        host_sequences: HostSequenceStore | None,
        shutdown_timeout: float,
        host_spawns: HostSpawnStore | None = None,
    ) -> None:
        self.provider = provider
        self.exporter = exporter
        self.database = database
        self.queue = queue
        self.export_processor = export_processor
        self.faults = faults
        self.shutdown_timeout = shutdown_timeout
        self._installed_source = installed_source
        self._previous_source = previous_source
        self._installed = installed
        self.ledger = ledger
        self._host_sequences = host_sequences
        self._host_spawns = host_spawns
        self._lock = threading.Lock()
        self._shut_down = False
        self.report: ShutdownReport | None = None

    # --- figures -----------------------------------------------------------------------------

    def stats(self) -> ExportStats:
        """What the export path did: the exporter's counters and the durable queue's figures
        (see ``ExportStats``); the same numbers the ``agentcap.*`` metrics report."""
        stats = self.exporter.stats()
        if self.queue is not None:
            for name, value in self.queue.stats().items():
                setattr(stats, name, value)
        return stats

    # --- lifecycle --------------------------------------------------------------------------

    def force_flush(
        self, timeout: float | None = None, *, timeout_millis: int | None = None
    ) -> bool:
        """Store everything captured so far, waiting at most ``timeout`` seconds (default
        ``shutdown_timeout``; ``timeout_millis`` as the SDK's ``force_flush`` takes it). Returns
        whether everything was stored; what was not stays queued and is delivered later."""
        seconds = self._seconds(timeout, timeout_millis)
        deadline = time.monotonic() + seconds
        if self.queue is not None:
            done = self.queue.flush(seconds)
        else:
            done = self.export_processor.force_flush(int(seconds * 1000))
        # The other processors (a collector's, say) get what is left of the time.
        others = self.provider.force_flush(max(0, int((deadline - time.monotonic()) * 1000)))
        return bool(done and others)

    def shutdown(
        self, timeout: float | None = None, *, timeout_millis: int | None = None
    ) -> ShutdownReport | None:
        """Flush for at most ``timeout`` seconds (default ``shutdown_timeout``, or 2 s when the
        database is down already), then stop.

        Whatever is not stored by then stays in the queue directory, is counted
        (``stats().spans_left``) and reported in one log line; the next process that uses the
        directory delivers it. Other span processors are given the rest of the time. Idempotent.
        """
        with self._lock:
            if self._shut_down:
                return self.report
            self._shut_down = True
        explicit = timeout is not None or timeout_millis is not None
        seconds = self._seconds(timeout, timeout_millis)
        deadline = time.monotonic() + seconds
        if self.queue is not None:
            self.report = self.queue.close(seconds if explicit else None)
            deadline = max(deadline, time.monotonic())
        self._run_with_deadline(self.provider.shutdown, deadline, "span processors")
        self._uninstall(deadline)
        if self._host_sequences is not None:
            self._host_sequences.close()
        if self._host_spawns is not None:
            self._host_spawns.close()
        self.database.close()
        return self.report

    def _seconds(self, timeout: float | None, timeout_millis: int | None) -> float:
        if timeout is None and timeout_millis is not None:
            timeout = timeout_millis / 1000
        return self.shutdown_timeout if timeout is None else max(0.0, float(timeout))

    @staticmethod
    def _run_with_deadline(fn: Any, deadline: float, what: str) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            except Exception:
                _logger.exception("agentcap: shutting down %s failed", what)
            finally:
                done.set()

        thread = threading.Thread(target=run, name="agentcap-shutdown", daemon=True)
        thread.start()
        if not done.wait(max(0.05, deadline - time.monotonic())):
            _logger.warning(
                "agentcap: %s did not shut down within the timeout; left to finish alone", what
            )

    def _uninstall(self, deadline: float) -> None:
        if self._installed_source is not None and self._previous_source is not None:
            current, _ = clocks.configuration()
            if current is self._installed_source:
                clocks.configure(*self._previous_source)
        for setting in reversed(self._installed):
            setting.restore()
        if self.ledger is not None:
            # Outcomes it could not write yet are tried again while the database is still open
            # (one attempt at least; it stops at the first failure).
            self.ledger.close(max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> AgentCap:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # --- the provider, for code written against earlier versions -------------------------

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self.provider.get_tracer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.provider, name)

    def __repr__(self) -> str:
        where = self.queue.directory.path if self.queue is not None else "no durable queue"
        return f"<AgentCap {target_of(self.database.dsn)} queue={where}>"


#: Handles by provider, for ``exporter_of(provider)`` (earlier versions' way to the exporter).
_handles: weakref.WeakKeyDictionary[TracerProvider, AgentCap] = weakref.WeakKeyDictionary()


#: The tables every batch writes (the writer role of ``db grant`` has INSERT on each).
_WRITTEN_TABLES: Final = ("runs", "agents", "spans", "events", "conflicts")


def _check_may_write(conn: psycopg.Connection[Any]) -> None:
    """Raise ConfigurationError when the role may not insert into the log (the reader role of
    ``db grant``, a login role given none): every batch would wait for it in the queue."""
    row = conn.execute(
        "SELECT current_user, array(SELECT t FROM unnest(%s::text[]) t "
        "WHERE NOT has_table_privilege('agentcap.' || quote_ident(t), 'INSERT'))",
        (list(_WRITTEN_TABLES),),
    ).fetchone()
    if row is not None and row[1]:
        missing = ", ".join(f"agentcap.{t}" for t in row[1])
        raise ConfigurationError(
            f"role {row[0]!r} may not write the event log (no INSERT on {missing}): give it the "
            "writer role of `otel-agentcap db grant` (GRANT agentcap_writer TO ...)"
        )


def _check_database(dsn: str, timeout: float) -> str | None:
    """Raise ConfigurationError for what the user must fix; migrate if the server answers.
    Returns why the server cannot be reached (it is then treated as down), or None."""
    try:
        psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"invalid PostgreSQL DSN: {first_line(exc, dsn)}") from None
    try:
        with psycopg.connect(dsn, connect_timeout=max(2, round(timeout)), autocommit=True) as conn:
            # A server that takes the connection and then answers nothing (a lock held on the
            # schema's tables, a hung backend) is down as well: the check waits no longer than
            # the connection may. A migration that is due runs without that bound.
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false)",
                (f"{max(1, round(timeout * 1000))}ms",),
            )
            try:
                due = bool(pending_versions(conn))
            except psycopg.errors.InsufficientPrivilege:
                due = True  # migrate says what the role lacks
            conn.execute("RESET statement_timeout")
            if due:
                migrate(conn)
            _check_may_write(conn)
    except psycopg.OperationalError as exc:
        text = first_line(exc, dsn)
        if any(marker in text for marker in _USER_ERRORS):
            raise ConfigurationError(f"cannot use PostgreSQL: {text}") from None
        return text
    except AgentCapStorageError as exc:  # e.g. a migration this role may not run
        raise ConfigurationError(f"cannot prepare the agentcap schema: {exc}") from None
    except psycopg.Error as exc:
        raise ConfigurationError(f"cannot use PostgreSQL: {first_line(exc, dsn)}") from None
    return None


def _number(name: str, value: object, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number of seconds, not {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise ConfigurationError(
            f"{name} must be {'at least 0' if zero else 'positive'}, not {value!r}"
        )


def _integer(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an integer, not {value!r}")
    if value < least:
        raise ConfigurationError(f"{name} must be at least {least}, not {value!r}")


def _check_options(options: dict[str, Any]) -> list[SpanProcessor]:
    """Raise ``ConfigurationError`` naming the first option of a wrong type or out of range,
    before anything is set up (a wrong type found later would be a TypeError from deep inside,
    or fail when spans end); returns ``span_processors`` as a list."""
    for name in ("dsn", "service_name"):
        if options[name] is not None and not isinstance(options[name], str):
            raise ConfigurationError(f"{name} must be a string, not {options[name]!r}")
    if options["resource"] is not None and not isinstance(options["resource"], Resource):
        raise ConfigurationError(
            f"resource must be an opentelemetry.sdk.resources.Resource, not {options['resource']!r}"
        )
    if options["queue_dir"] is not None and not isinstance(options["queue_dir"], str | os.PathLike):
        raise ConfigurationError(f"queue_dir must be a path, not {options['queue_dir']!r}")
    if options["fsync"] not in FSYNC_POLICIES:
        raise ConfigurationError(f"fsync must be one of {FSYNC_POLICIES}, not {options['fsync']!r}")
    if options["overflow"] not in OVERFLOW_POLICIES:
        raise ConfigurationError(
            f"overflow must be one of {OVERFLOW_POLICIES}, not {options['overflow']!r}"
        )
    _integer("max_queue_bytes", options["max_queue_bytes"], 64 * 1024)
    _integer("writers", options["writers"], 1)
    if options["queue_size"] is not None:
        _integer("queue_size", options["queue_size"], 1)
    _number("block_timeout", options["block_timeout"])
    _number("connect_timeout", options["connect_timeout"])
    _number("shutdown_timeout", options["shutdown_timeout"], zero=True)
    if options["sdk_tools_exactly_once"] not in (None, True, False):
        raise ConfigurationError(
            f"sdk_tools_exactly_once must be True, False or None, not "
            f"{options['sdk_tools_exactly_once']!r}"
        )
    given = options["span_processors"]
    if isinstance(given, str | bytes) or not isinstance(given, Iterable):
        raise ConfigurationError(
            f"span_processors must be a list of span processors, not {given!r}"
        )
    processors = list(given)
    for processor in processors:
        if not all(
            callable(getattr(processor, method, None))
            for method in ("on_start", "on_end", "shutdown", "force_flush")
        ):
            raise ConfigurationError(
                f"span_processors must hold span processors (on_start, on_end, shutdown, "
                f"force_flush), not {processor!r}"
            )
    return processors


def configure(
    dsn: str | None = None,
    *,
    span_processors: Iterable[SpanProcessor] = (),
    service_name: str | None = None,
    resource: Resource | None = None,
    set_global: bool = True,
    batch: bool = True,
    durable: bool = True,
    queue_dir: str | os.PathLike[str] | None = None,
    fsync: FsyncPolicy = "interval",
    max_queue_bytes: int = DEFAULT_MAX_BYTES,
    queue_size: int | None = None,
    overflow: Overflow = "block",
    block_timeout: float = 2.0,
    writers: int = 2,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    connect_timeout: float = 5.0,
    sequence_blocks: bool = True,
    tool_ledger: bool = True,
    sdk_tools_exactly_once: bool | None = None,
    metrics_enabled: bool = True,
    announce: bool = True,
    instrument: bool = True,
) -> AgentCap:
    """Set up capture into the PostgreSQL event log; returns the :class:`AgentCap` handle.

    * ``dsn``: the database; default ``AGENTCAP_DSN``, else an embedded PostgreSQL (started or
      reused, data under the user's data directory; its location is printed to stderr).
    * ``span_processors``: further processors, e.g.
      ``BatchSpanProcessor(OTLPSpanExporter())`` for a collector; they see agentcap's stamps.
    * ``durable`` (default): ended spans go to a durable queue on local disk, in
      ``queue_dir`` (default ``AGENTCAP_QUEUE_DIR``, else ``/var/lib/otel-agentcap/queue`` for
      root, else the user's state directory), delivered to PostgreSQL in the background; what a
      crashed or stopped process leaves there is delivered by the next one. ``fsync``: when
      appended spans are flushed to the disk (``"interval"``: every second; ``"always"``;
      ``"never"``). ``max_queue_bytes``: the queue's bound on disk (1 GiB).
    * ``overflow``, ``block_timeout``: what a full queue does: ``"block"`` (wait up to
      ``block_timeout`` seconds for room, then drop) or ``"drop"``; drops are counted.
    * ``queue_size``: spans held in memory: without the durable queue (``durable=False``), the
      export queue (default ``OTEL_BSP_MAX_QUEUE_SIZE``, else 2,048); with it, the fallback used
      while the disk refuses writes (10,000).
    * ``batch=False``: export synchronously on the thread that ends each span (no queue).
    * ``writers``: parallel connections that store events (split by agent).
    * ``shutdown_timeout``: the default time ``shutdown()`` and ``force_flush()`` wait.
    * ``sequence_blocks``: reserve sequence blocks in the database (through this host's
      ``sequences.sqlite3`` in the queue directory, which gives blocks while the database is
      down), so several processes serving one agent never repeat a sequence.
    * ``tool_ledger``: protect ``Tool.invoke`` calls with the PostgreSQL tool ledger, so an
      invocation runs once across every process serving the run (see the README, Tools).
    * ``sdk_tools_exactly_once``: True makes the anthropic SDK's tool runners and toolsets run each
      tool_use exactly once (like ``Tool.invoke``); False (their default) records every execution
      the SDK makes, as it makes it; None leaves the setting as it is.
    * ``metrics_enabled``: report the export path's figures as ``agentcap.*`` metrics on the
      global MeterProvider (no-op when none is set).
    * ``set_global``: install the provider as the global one (capture uses the global provider);
      raises ``ConfigurationError`` when a global provider is set already (OpenTelemetry keeps
      the first, so this one would record nothing).
    * ``instrument``: instrument the libraries installed that need it for a full record (see
      :func:`otel_agentcap.instrumentation.instrument_installed`: the anthropic SDK's causal
      links); ``False`` leaves instrumentation to the caller.

    Spawns are registered in the database when they happen (while it is down, in this host's
    ``spawns.sqlite3`` in the queue directory, and in the database when their events are
    delivered), so a spawn retried in any process gets the same child and spawn event; ``PostgresMemory`` uses this database by default; a run id
    is claimed in the database when its run opens (``run(run_id)`` on a stored run needs
    ``resume=True`` or a carried context, see ``otel_agentcap.capture.runs``). The handle owns
    all of it: its ``shutdown()`` closes the tool ledger and the database and restores what these
    settings were before.

    Raises :class:`~otel_agentcap.errors.ConfigurationError` at once for what the user must fix:
    an option of a wrong type or out of range (before anything is set up), a DSN that does not
    parse, a failed authentication, a database or role that does not exist,
    a schema this role cannot create. A server that is down (or still starting) is not an error:
    its events wait in the durable queue, and one line says so.
    """
    span_processors = _check_options(locals())
    if set_global:
        _check_no_global_provider()
    try:
        limits = SpanLimits()  # the environment's
    except ValueError as exc:  # checked before anything is set up
        raise ConfigurationError(f"invalid span limit in the environment: {exc}") from None
    resolved = resolve_dsn(dsn, announce=announce)
    unreachable = _check_database(resolved, connect_timeout)
    faults = FaultLog()
    database = Database(resolved)
    exporter = PostgresSpanExporter(
        database=database, owns_database=False, writers=writers, faults=faults
    )
    directory = QueueDirectory(
        Path(queue_dir) if queue_dir is not None else default_base_dir(), target_of(resolved)
    )
    queue: DurableSpanProcessor | None = None
    export_processor: SpanProcessor
    if batch and durable:
        queue = DurableSpanProcessor(
            exporter,
            directory,
            QueueSettings(
                fsync=fsync,
                max_bytes=max_queue_bytes,
                overflow=overflow,
                block_timeout=block_timeout,
                memory_limit=queue_size or QueueSettings.memory_limit,
                shutdown_timeout=shutdown_timeout,
            ),
            faults=faults,
        )
        export_processor = queue
    elif batch:
        export_processor = EventLogSpanProcessor(
            exporter,
            max_queue_size=queue_size,
            overflow=overflow,
            block_timeout=block_timeout,
            on_drop=exporter.count_dropped,
        )
    else:
        export_processor = SynchronousSpanProcessor(exporter)
    if unreachable is not None:
        faults.fault(
            DATABASE_CONDITION,
            f"not reachable at start ({unreachable})",
            consequence=(
                f"events wait in the queue {directory.path} until it is"
                if queue is not None
                else "events wait in memory and are retried"
            ),
        )
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        # The SDK's own test: its providers then hand out tracers that record nothing.
        _logger.warning(
            "agentcap: OTEL_SDK_DISABLED=true turns the OpenTelemetry SDK off: no span is "
            "recorded, so nothing is stored in the event log"
        )
    provider = TracerProvider(
        # Every span recorded, for the event log; OTEL_TRACES_SAMPLER still decides which are
        # sampled (exported by the SDK's processors, e.g. to a collector).
        sampler=configured_sampler(),
        # The environment's limits are for what is exported: the log's spans are not cut, and
        # the further processors see each span as those limits would have left it.
        span_limits=provider_limits(limits),
        resource=resource if resource is not None else _resource(service_name),
    )
    provider.add_span_processor(AgentCapSpanProcessor())
    provider.add_span_processor(export_processor)
    for processor in span_processors:
        provider.add_span_processor(
            LimitedView(processor, limits) if needs_view(limits) else processor
        )
    installed_source: SequenceSource | None = None
    previous_source = clocks.configuration()
    host_sequences: HostSequenceStore | None = None
    if sequence_blocks:
        remote = PostgresSequenceSource(database)
        if durable:
            host_sequences = HostSequenceStore(directory.sequences)
            installed_source = HostAwareSequenceSource(remote, host_sequences, faults=faults)
        else:
            installed_source = remote
        clocks.configure(installed_source)
    ledger = PostgresToolLedger(database) if tool_ledger else None
    installed_spawns: SpawnRegistry = PostgresSpawnRegistry(database)
    host_spawns: HostSpawnStore | None = None
    if durable:
        # While PostgreSQL is down, the processes of this host agree on spawns through a file
        # in the queue directory; the delivery registers them (see host_spawns).
        host_spawns = HostSpawnStore(directory.spawns)
        installed_spawns = HostAwareSpawnRegistry(installed_spawns, host_spawns, faults=faults)
    installed = [
        _Installed.install(spawn_registry, set_spawn_registry, installed_spawns),
        _Installed.install(run_registry, set_run_registry, PostgresRunRegistry(database)),
        _Installed.install(current_tool_ledger, set_tool_ledger, ledger),
        _Installed.install(default_database, set_default_database, database),
    ]
    if sdk_tools_exactly_once is not None:
        installed.append(
            _Installed.install(
                current_sdk_tools_exactly_once, set_sdk_tools_exactly_once, sdk_tools_exactly_once
            )
        )
    _telemetry.refresh_content_capture()
    if set_global:
        trace.set_tracer_provider(provider)
    handle = AgentCap(
        provider,
        exporter,
        database,
        queue=queue,
        export_processor=export_processor,
        faults=faults,
        installed_source=installed_source,
        previous_source=previous_source,
        installed=installed,
        ledger=ledger,
        host_sequences=host_sequences,
        host_spawns=host_spawns,
        shutdown_timeout=shutdown_timeout,
    )
    _handles[provider] = handle
    if metrics_enabled:
        metrics.register(handle, AgentCap.stats)
    if instrument:
        instrument_installed()
    return handle


def exporter_of(configured: AgentCap | TracerProvider) -> PostgresSpanExporter | None:
    """The PostgreSQL exporter of a :func:`configure` handle (or of its provider)."""
    if isinstance(configured, AgentCap):
        return configured.exporter
    handle = _handles.get(configured)
    return handle.exporter if handle is not None else None


__all__ = ["AgentCap", "ConfigurationError", "ShutdownReport", "configure", "exporter_of"]
