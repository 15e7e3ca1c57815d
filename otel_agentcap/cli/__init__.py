"""The ``otel-agentcap`` command line (:mod:`.commands`) and the layout of a run it prints
(:mod:`.timeline`). ``python -m otel_agentcap.cli`` runs it too."""

from otel_agentcap.cli.commands import (
    BINARY_FORMATS,
    EXPORT_FORMATS,
    CliError,
    build_parser,
    cmd_db,
    cmd_demo,
    cmd_event,
    cmd_export,
    cmd_import,
    cmd_ingest,
    cmd_queue,
    cmd_runs,
    cmd_show,
    cmd_ui,
    main,
)

__all__ = [
    "BINARY_FORMATS",
    "EXPORT_FORMATS",
    "CliError",
    "build_parser",
    "cmd_db",
    "cmd_demo",
    "cmd_event",
    "cmd_export",
    "cmd_import",
    "cmd_ingest",
    "cmd_queue",
    "cmd_runs",
    "cmd_show",
    "cmd_ui",
    "main",
]
