"""The formats of ``otel-agentcap export``: a registry, so another format (a web page, say) is one
:func:`register_format` call away. A format turns a :class:`~.snapshot.RunSnapshot` (everything the
log holds of a run) into the bytes of a file; the same snapshot always gives the same bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from otel_agentcap.transfer import agentcap_pb, jaeger_json, otlp_json
from otel_agentcap.transfer.snapshot import RunReader, RunSnapshot, load_run, read_run
from otel_agentcap.transfer.traces import rebuild


@dataclass(frozen=True, slots=True)
class ExportFormat:
    name: str
    #: One line for ``--help``.
    description: str
    write: Callable[[RunSnapshot], bytes]
    #: Whether the output is text (printed to a terminal) or binary.
    binary: bool = False
    #: Whether ``otel-agentcap import`` reads it back.
    importable: bool = False
    #: Writes the run to a file as it is built and returns the bytes written, the same bytes as
    #: ``write`` gives (None: ``write`` is used): agentcap-pb a batch at a time, in memory that
    #: does not grow with the run; the trace formats a span at a time, from the whole trace.
    stream: Callable[[RunReader, BinaryIO], int] | None = None


_lock = threading.Lock()
_formats: dict[str, ExportFormat] = {}


def register_format(fmt: ExportFormat) -> None:
    """Make ``fmt`` available to ``otel-agentcap export --format NAME``; a name can be registered
    once."""
    with _lock:
        if fmt.name in _formats:
            raise ValueError(f"export format {fmt.name!r} is registered already")
        _formats[fmt.name] = fmt


def export_formats() -> dict[str, ExportFormat]:
    with _lock:
        return dict(_formats)


def export_run(conn: Any, run_id: str, format_name: str) -> bytes:
    """The run ``run_id`` of the log behind ``conn`` in the format ``format_name``."""
    fmt = export_formats().get(format_name)
    if fmt is None:
        raise ValueError(f"unknown export format {format_name!r}")
    return fmt.write(load_run(conn, run_id))


def export_run_to(
    conn: Any, run_id: str, format_name: str, open_output: Callable[[], BinaryIO]
) -> int:
    """Write the run ``run_id`` in the format ``format_name`` to the file ``open_output()``
    opens (called once the run is found, and closed after) and return the bytes written: batch
    by batch for a format that streams, else whole."""
    fmt = export_formats().get(format_name)
    if fmt is None:
        raise ValueError(f"unknown export format {format_name!r}")
    if fmt.stream is None:
        data = fmt.write(load_run(conn, run_id))
        with open_output() as out:
            out.write(data)
        return len(data)
    with read_run(conn, run_id) as reader, open_output() as out:
        return fmt.stream(reader, out)


register_format(
    ExportFormat(
        "agentcap-pb",
        "the log's own rows (proto/agentcap/eventlog/v1), length-delimited protobuf",
        agentcap_pb.dumps,
        binary=True,
        importable=True,
        stream=agentcap_pb.write_run,
    )
)
register_format(
    ExportFormat(
        "otlp-json",
        "the run's trace as an OTLP/JSON ExportTraceServiceRequest",
        lambda snapshot: otlp_json.dumps(rebuild(snapshot)),
        importable=True,
        stream=lambda reader, out: otlp_json.write(rebuild(reader.snapshot()), out),
    )
)
register_format(
    ExportFormat(
        "jaeger-json",
        "the run's trace as Jaeger's /api/traces JSON (the Jaeger UI opens it from a file)",
        lambda snapshot: jaeger_json.dumps(rebuild(snapshot)),
        stream=lambda reader, out: jaeger_json.write(rebuild(reader.snapshot()), out),
    )
)
