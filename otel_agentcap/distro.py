"""The agentcap OpenTelemetry distro and configurator, for ``opentelemetry-instrument``.

One variable selects them::

    OTEL_PYTHON_DISTRO=agentcap opentelemetry-instrument python app.py

:class:`AgentCapDistro` then sets the defaults of this setup, each only where the variable is
unset: traces go to the event log (``OTEL_TRACES_EXPORTER=agentcap``), no metrics and no logs are
exported (``OTEL_METRICS_EXPORTER=none``, ``OTEL_LOGS_EXPORTER=none``), an ``otlp`` exporter
speaks ``http/protobuf`` (the exporter the ``otlp`` extra installs), the configurator is this
package's (``OTEL_PYTHON_CONFIGURATOR=agentcap``), and on an anthropic SDK that traces itself
another Anthropic instrumentation is not loaded (``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=anthropic``:
it would record every call twice). :class:`AgentCapConfigurator` builds what
:func:`otel_agentcap.configure.configure` builds (span processor first, the event log's export
queue, sequence blocks, spawn lookup) with the resource, sampler and further trace exporters
named in the environment, and sets up metrics or logs exporters only when they are asked for.
The ``agentcap_anthropic`` instrumentor entry point then instruments the anthropic SDK.

Installed next to another distro (``opentelemetry-distro``) and not selected, both step aside:
``opentelemetry-instrument`` picks the first distro and configurator it finds when none is named,
so when that is one of ours, it runs the other package's instead, and installing otel-agentcap
changes nothing for a program that does not ask for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.environment_variables import (
    OTEL_LOGS_EXPORTER,
    OTEL_METRICS_EXPORTER,
    OTEL_TRACES_EXPORTER,
)
from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]
from opentelemetry.instrumentation.environment_variables import (
    OTEL_PYTHON_CONFIGURATOR,
    OTEL_PYTHON_DISABLED_INSTRUMENTATIONS,
    OTEL_PYTHON_DISTRO,
)
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from otel_agentcap import private_parts
from otel_agentcap.pipeline.processor import AgentCapSpanProcessor

_logger = logging.getLogger(__name__)

#: The entry-point name of the distro, the configurator and the trace exporter.
NAME: Final = "agentcap"
_OTLP_BY_PROTOCOL: Final = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
#: What installs each OTLP exporter: the ``otlp`` extra brings the HTTP one only.
_INSTALL_HINTS: Final = {
    "otlp_proto_http": " (pip install 'otel-agentcap[otlp]')",
    "otlp_proto_grpc": " (pip install opentelemetry-exporter-otlp-proto-grpc)",
}


def _selected(variable: str) -> bool:
    return os.environ.get(variable, "").strip() == NAME


def _others(group: str) -> list[EntryPoint]:
    """The entry points of ``group`` that are not this package's, in discovery order."""
    return [ep for ep in entry_points(group=group) if ep.name != NAME]


def _load_other(group: str) -> Any | None:
    """An instance of the first other entry point of ``group`` (the one ``opentelemetry-instrument``
    would have picked without this package), or None."""
    for entry_point in _others(group):
        try:
            return entry_point.load()()
        except Exception:
            _logger.warning(
                "agentcap: could not load %s %r", group, entry_point.name, exc_info=True
            )
    return None


def _defaults() -> dict[str, str]:
    from otel_agentcap.instrumentation.anthropic import sdk_traces_itself

    defaults = {
        OTEL_PYTHON_CONFIGURATOR: NAME,
        OTEL_TRACES_EXPORTER: NAME,
        OTEL_METRICS_EXPORTER: "none",
        OTEL_LOGS_EXPORTER: "none",
        OTEL_EXPORTER_OTLP_PROTOCOL: "http/protobuf",
    }
    if sdk_traces_itself():
        defaults[OTEL_PYTHON_DISABLED_INSTRUMENTATIONS] = "anthropic"
    return defaults


class AgentCapDistro(BaseDistro):  # type: ignore[misc]
    """Selected with ``OTEL_PYTHON_DISTRO=agentcap``: sets the defaults of the agentcap setup
    (module documentation). Not selected, it configures as the next installed distro would."""

    _delegate: Any = None

    def _configure(self, **kwargs: Any) -> None:
        self._delegate = None
        if not _selected(OTEL_PYTHON_DISTRO):
            self._delegate = _load_other("opentelemetry_distro")
            if self._delegate is not None:
                self._delegate.configure(**kwargs)
            return
        for variable, value in _defaults().items():
            os.environ.setdefault(variable, value)

    def load_instrumentor(self, entry_point: Any, **kwargs: Any) -> None:
        if self._delegate is not None:
            self._delegate.load_instrumentor(entry_point, **kwargs)
        else:
            super().load_instrumentor(entry_point, **kwargs)


def _exporter_names(variable: str) -> list[str]:
    value = os.environ.get(variable, "").strip()
    if not value or value.lower() == "none":
        return []
    return [name.strip() for name in value.split(",") if name.strip()]


def _otlp_protocol() -> tuple[str, str]:
    """The configured OTLP protocol for traces and the variable that sets it (``grpc`` when
    none does, as in the SDK)."""
    for variable in (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL):
        if os.environ.get(variable):
            return os.environ[variable].strip(), variable
    return "grpc", OTEL_EXPORTER_OTLP_PROTOCOL


def _entry_point_name(name: str) -> str:
    """``otlp`` stands for the exporter of the configured protocol, as in the SDK."""
    if name != "otlp":
        return name
    return _OTLP_BY_PROTOCOL.get(_otlp_protocol()[0], name)


def _trace_exporters(names: Iterable[str]) -> list[SpanExporter]:
    """Instances of the trace exporters named (other than ``agentcap``); one that is not
    installed, or fails to start, is logged on one line and left out."""
    exporters: list[SpanExporter] = []
    for name in names:
        protocol, variable = _otlp_protocol()
        if name == "otlp" and protocol not in _OTLP_BY_PROTOCOL:
            _logger.error(
                "agentcap: %s is %r, but the otlp exporters speak %s; not exporting there",
                variable,
                protocol,
                " or ".join(_OTLP_BY_PROTOCOL),
            )
            continue
        resolved = _entry_point_name(name)
        found = list(entry_points(group="opentelemetry_traces_exporter", name=resolved))
        if not found:
            hint = _INSTALL_HINTS.get(resolved, "")
            _logger.error(
                "agentcap: %s names %r, but no installed package provides it%s; not exporting there",
                OTEL_TRACES_EXPORTER,
                name,
                hint,
            )
            continue
        try:
            exporters.append(found[0].load()())
        except Exception as exc:
            _logger.error("agentcap: trace exporter %r could not start: %s", name, exc)
    return exporters


def _init_metrics_and_logs(resource: Resource) -> None:
    """Metrics and logs exporters, only those asked for, set up as the SDK's configurator does."""
    metric_names = _exporter_names(OTEL_METRICS_EXPORTER)
    log_names = _exporter_names(OTEL_LOGS_EXPORTER)
    if not metric_names and not log_names:
        return
    # Beware: private functions of the SDK's own configurator (opentelemetry.sdk._configuration),
    # reused so that metrics and logs are set up exactly as opentelemetry-distro sets them up.
    # Tested with opentelemetry-sdk 1.34 and 1.45.
    try:
        from opentelemetry.sdk import _configuration as sdk_configuration

        import_exporters: Callable[..., Any] = sdk_configuration._import_exporters  # noqa: SLF001 (see above)
        init_metrics: Callable[..., Any] = sdk_configuration._init_metrics  # noqa: SLF001 (see above)
        init_logging: Callable[..., Any] = sdk_configuration._init_logging  # noqa: SLF001 (see above)
    except (ImportError, AttributeError):
        private_parts.missing(
            "opentelemetry-sdk",
            "opentelemetry.sdk._configuration._init_metrics",
            "metrics and logs exporters are not set up under OTEL_PYTHON_DISTRO=agentcap",
        )
        return
    try:
        _, metric_exporters, log_exporters = import_exporters([], metric_names, log_names)
    except Exception as exc:
        _logger.error("agentcap: metrics or logs exporter not set up: %s", exc)
        return
    if metric_exporters:
        init_metrics(metric_exporters, resource)
    if log_exporters:
        init_logging(log_exporters, resource)


class AgentCapConfigurator:
    """Selected with ``OTEL_PYTHON_CONFIGURATOR=agentcap`` (which ``OTEL_PYTHON_DISTRO=agentcap``
    sets): configures the SDK for the event log (module documentation). Not selected, it runs
    the next installed configurator, or nothing.

    ``opentelemetry-instrument`` calls ``configure(auto_instrumentation_version=...)`` once. A
    configuration error (the embedded server cannot start, say) is logged and the program runs
    without capture: it is never raised into the program.
    """

    def configure(self, **kwargs: Any) -> None:
        if not _selected(OTEL_PYTHON_CONFIGURATOR):
            other = _load_other("opentelemetry_configurator")
            if other is not None:
                other.configure(**kwargs)
            return
        try:
            self._configure(**kwargs)
        except Exception as exc:
            _logger.error("agentcap: not recording (configuration failed: %s)", exc)
            _logger.debug("agentcap: configuration failed", exc_info=True)

    def _configure(self, **kwargs: Any) -> None:
        version = kwargs.get("auto_instrumentation_version")
        resource = Resource.create({"telemetry.auto.version": version} if version else {})
        names = _exporter_names(OTEL_TRACES_EXPORTER)
        others = _trace_exporters(name for name in names if name != NAME)
        processors = [BatchSpanProcessor(exporter) for exporter in others]
        if NAME in names:
            from otel_agentcap.configure import configure

            # The instrumentor entry points instrument the SDK under opentelemetry-instrument
            # (and honour OTEL_PYTHON_DISABLED_INSTRUMENTATIONS), so configure() does not.
            configure(resource=resource, span_processors=processors, instrument=False)
        else:
            # Stamps for the other exporters only, e.g. OTLP to a collector and `ingest`.
            provider = TracerProvider(resource=resource)
            provider.add_span_processor(AgentCapSpanProcessor())
            for processor in processors:
                provider.add_span_processor(processor)
            trace.set_tracer_provider(provider)
        _init_metrics_and_logs(resource)
